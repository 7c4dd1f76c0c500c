// `ferry`: inspect, verify, convert and benchmark TensorFerry checkpoints and safetensors files.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <new>
#include <string>
#include <system_error>

#include "cli.hpp"

int main(int argc, char** argv) {
  using namespace ferry::cli;
  CLI::App app{
      "ferry: inspect, verify, convert (safetensors <-> TensorFerry) and benchmark tensor "
      "checkpoints.\nFiles are recognised by content: TensorFerry checkpoints and .safetensors "
      "files both work everywhere a FILE is read."};
  app.require_subcommand(1);
  app.set_version_flag("-V,--version", std::string("ferry ") + ferry::VersionString());
  app.add_flag("-q,--quiet", g_quiet,
               "no progress display and no summary of a job that succeeded (errors still print)");
  // --quiet may also follow the subcommand: `ferry convert a b --quiet`.
  app.fallthrough();

  InspectOptions inspect;
  CLI::App* inspect_cmd = app.add_subcommand(
      "inspect", "List tensors, quantized tensors, FP8 recipes and scaling state, metadata");
  inspect_cmd->add_option("FILE", inspect.file, "checkpoint or .safetensors file")->required();
  inspect_cmd->add_flag("--json", inspect.json, "machine-readable output on stdout");

  VerifyOptions verify;
  CLI::App* verify_cmd = app.add_subcommand(
      "verify", "Check every checksum; exit 1 naming each tensor and block that mismatches");
  verify_cmd->add_option("FILE", verify.file, "checkpoint or .safetensors file")->required();
  verify_cmd->add_option("--threads", verify.threads, "worker threads (0: one per core)")
      ->check(CLI::Range(0, 1024));
  verify_cmd->add_flag("--json", verify.json, "machine-readable report on stdout");

  // One list of encoding names for every subcommand (ParseEncoding).
  const auto encoding_check = CLI::Validator(
      [](std::string& name) {
        return ParseEncoding(name) ? std::string() : "give one of " + std::string(kEncodingNames);
      },
      "ENCODING", "encoding");

  ConvertOptions convert;
  CLI::App* convert_cmd = app.add_subcommand(
      "convert",
      "Convert between formats, chosen by --to or by OUT's extension: .ferry writes a "
      "TensorFerry checkpoint, .safetensors a safetensors file (any other name needs --to). "
      "IN may be a model.safetensors.index.json: all its shards go into one file.");
  convert_cmd->add_option("IN", convert.in, "checkpoint, .safetensors, or sharded index .json")
      ->required();
  convert_cmd->add_option("OUT", convert.out, "output file (replaced atomically)")->required();
  convert_cmd
      ->add_option("--to", convert.to,
                   "output format, for an OUT named other than *.ferry or *.safetensors")
      ->check(CLI::IsMember({"ferry", "tensorferry", "safetensors"}));
  convert_cmd
      ->add_option("--encoding", convert.encoding,
                   std::string("TensorFerry output encoding: ") + kEncodingNames)
      ->capture_default_str()
      ->check(encoding_check);
  convert_cmd->add_option("--level", convert.level, "zstd level")
      ->capture_default_str()
      ->check(CLI::Range(-7, 22));
  convert_cmd
      ->add_option("--block-size", convert.block_size,
                   "bytes per checksum block and zstd chunk (power of two, e.g. 4MiB)")
      ->capture_default_str();
  convert_cmd->add_option("--threads", convert.threads, "compression threads (0: automatic)")
      ->check(CLI::Range(0, 1024));

  BenchOptions bench;
  CLI::App* bench_cmd = app.add_subcommand(
      "bench",
      "Load throughput onto the current GPU (host memory without one), beside the hardware "
      "ceiling measured in the same run");
  auto* file_opt = bench_cmd->add_option("FILE", bench.file, "checkpoint or .safetensors file");
  auto* gen_opt = bench_cmd->add_option(
      "--generate", bench.generate,
      "write a temporary checkpoint of this size (e.g. 1GiB, 512MiB) of bf16 tensors in a "
      "llama-like layout, then bench it");
  file_opt->excludes(gen_opt);
  bench_cmd->add_option("--dir", bench.dir,
                        "directory for --generate (default: /dev/shm when usable, else TMPDIR)");
  bench_cmd->add_flag("--keep", bench.keep, "keep the generated checkpoint");
  bench_cmd->add_option("--threads", bench.threads, "loader threads (0: automatic)")
      ->check(CLI::Range(0, 1024));
  bench_cmd->add_option("--slot-mib,--chunk-mib", bench.slot_mib, "MiB per staging slot and copy")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  bench_cmd->add_option("--staging-mib", bench.staging_mib, "pinned staging ring MiB")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  bench_cmd->add_option("--path", bench.path, "host path to the GPU")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "staging", "register", "register-windows"}));
  bench_cmd
      ->add_option("--io", bench.io,
                   "how bytes leave the file: page-cache (the mapping), direct (O_DIRECT), or "
                   "auto (by page-cache residency)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "page-cache", "direct"}));
  bench_cmd->add_option("--repeat", bench.repeat, "timed loads")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  bench_cmd->add_option("--device", bench.device,
                        "CUDA device to make current first (default: the current one)");
  bench_cmd->add_flag("--verify", bench.verify, "check checksums while loading");
  bench_cmd
      ->add_option("--encoding", bench.encoding,
                   std::string("encoding of the --generate checkpoint: ") + kEncodingNames)
      ->capture_default_str()
      ->check(encoding_check);
  bench_cmd->add_option("--dtype", bench.dtype, "element type of the --generate checkpoint")
      ->capture_default_str()
      ->check(CLI::IsMember({"bf16", "f8_e4m3", "f8_e5m2"}));
  bench_cmd->add_flag("--cold", bench.cold,
                      "evict the file from the page cache first: the first load reads the disk "
                      "(printed beside the disk's O_DIRECT read rate)");
  bench_cmd->add_flag("--prealloc", bench.prealloc,
                      "load into destination buffers allocated once, outside the timed runs "
                      "(default: the loader allocates, as most callers let it)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }

  // The library reports failures as Status; what still throws (an allocation, a thread the
  // system refuses) is caught here, after the unwinding has removed any temporary file.
  try {
    if (inspect_cmd->parsed()) return RunInspect(inspect);
    if (verify_cmd->parsed()) return RunVerify(verify);
    if (convert_cmd->parsed()) return RunConvert(convert);
    if (bench_cmd->parsed()) {
      if (bench.file.empty() == bench.generate.empty()) {
        std::fprintf(stderr, "ferry bench: give a FILE or --generate SIZE\n");
        return kExitUsage;
      }
      return RunBench(bench);
    }
  } catch (const std::bad_alloc&) {
    return Fail(ferry::Status(ferry::StatusCode::kResourceExhausted, "out of memory"));
  } catch (const std::system_error& e) {
    return Fail(ferry::Status(ferry::StatusCode::kResourceExhausted, e.what()));
  } catch (const std::exception& e) {
    return Fail(ferry::Status(ferry::StatusCode::kInternal, e.what()));
  }
  return kExitUsage;
}
