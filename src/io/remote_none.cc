// OpenRemoteSource and OpenRemoteSink for builds without an HTTP client (src/io/remote.hpp).
#include "base/util.hpp"
#include "io/remote.hpp"
#include "io/remote_sink.hpp"

namespace ferry {

Result<std::shared_ptr<ByteSource>> OpenRemoteSource(const std::string& url,
                                                     const SourceOptions& options) {
  (void)options;
  return Error(StatusCode::kUnimplemented, PrintableUrl(url),
               ": this build of TensorFerry reads no remote storage (built without libcurl)");
}

Result<std::unique_ptr<RemoteSink>> OpenRemoteSink(const std::string& url) {
  return Error(StatusCode::kUnimplemented, PrintableUrl(url),
               ": this build of TensorFerry writes no remote storage (built without libcurl)");
}

}  // namespace ferry
