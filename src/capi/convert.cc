// ferry_convert, ferry_convert_to: PyTorch, safetensors and TensorFerry files into a
// TensorFerry or safetensors file.

#include "capi/internal.hpp"
#include "import/torch/import_writer.hpp"

using namespace ferry::capi;  // NOLINT(build/namespaces): the entry points are shells over these

extern "C" {

int ferry_convert(const char* src, const char* dst, const ferry_writer_options_t* options,
                  ferry_error_t* error) {
  return ferry_convert_to(src, dst, nullptr, options, error);
}

int ferry_convert_to(const char* src, const char* dst, const char* format,
                     const ferry_writer_options_t* options, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(src);
    FERRY_C_REQUIRE(dst);
    ferry::WriterOptions o;
    int rc = ToWriterOptions(dst, options, fn, &o, error);
    if (rc != FERRY_OK) return rc;
    return Report(ferry::torch_import::ConvertCheckpoint(src, dst, o, format ? format : ""), error);
  });
}

}  // extern "C"
