// Builds without libcurl (FERRY_REMOTE=OFF) read local files only.
#include "base/util.hpp"
#include "io/remote.hpp"
#include "io/url.hpp"

namespace ferry {

Result<std::shared_ptr<ByteSource>> OpenRemoteSource(const std::string& url, const SourceOptions&) {
  return Error(StatusCode::kUnimplemented, RedactUrl(url),
               ": this build of TensorFerry reads local files only (built with "
               "FERRY_REMOTE=OFF, without libcurl)");
}

}  // namespace ferry
