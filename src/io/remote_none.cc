// OpenRemoteSource for builds without an HTTP client (src/io/remote.hpp).
#include "base/util.hpp"
#include "io/remote.hpp"

namespace ferry {

Result<std::shared_ptr<ByteSource>> OpenRemoteSource(const std::string& url,
                                                     const SourceOptions& options) {
  (void)options;
  return Error(StatusCode::kUnimplemented, PrintableUrl(url),
               ": this build of TensorFerry reads no remote storage (built without libcurl)");
}

}  // namespace ferry
