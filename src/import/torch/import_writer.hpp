// Writes an imported PyTorch checkpoint (torch_checkpoint.hpp) as a TensorFerry checkpoint
// or as a safetensors file. Shared by `ferry convert` and the C API's ferry_convert.
#ifndef FERRY_SRC_IMPORT_TORCH_IMPORT_WRITER_HPP_
#define FERRY_SRC_IMPORT_TORCH_IMPORT_WRITER_HPP_

#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/ferry.hpp"
#include "import/torch/torch_checkpoint.hpp"

namespace ferry::torch_import {

struct ImportWriteOptions {
  WriterOptions writer;
  // safetensors output: has no place for scaling state, so a checkpoint with some is refused
  // unless the caller carries it in `extra_metadata` (as `ferry convert` does, in the
  // metadata keys that it reads back) and sets this.
  bool scaling_in_metadata = false;
  std::vector<std::pair<std::string, std::string>> extra_metadata;
  // Called with each piece of tensor bytes written (progress display); may be empty.
  std::function<void(uint64_t)> progress;
  // The output format, as ChooseOutputFormat takes it ("": by the extension of `out`).
  std::string to;
};

// Writes the format ChooseOutputFormat(out, options.to) picks (an unknown extension is
// refused). Atomic: `out` is replaced only on success.
Status WriteImported(const TorchCheckpoint& ck, const std::string& out,
                     const ImportWriteOptions& options);

// The C API's ferry_convert: a PyTorch input (TorchCheckpoint::Recognises) through
// WriteImported; a safetensors or TensorFerry input copied into a TensorFerry checkpoint.
Status ConvertCheckpoint(const std::string& in, const std::string& out,
                         const WriterOptions& options, std::string_view to = {});

}  // namespace ferry::torch_import

#endif  // FERRY_SRC_IMPORT_TORCH_IMPORT_WRITER_HPP_
