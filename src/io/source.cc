// The parts of ByteSource every source shares. Local sources (mapped files, network file
// systems) join OpenSource with the reader's move onto this interface.
#include "io/source.hpp"

#include "base/util.hpp"
#include "io/remote.hpp"

namespace ferry {

const std::shared_ptr<const Mapping>& ByteSource::mapping() const {
  static const std::shared_ptr<const Mapping> kNone;
  return kNone;
}

Status ByteSource::ReadRanges(std::span<const ReadRange> ranges) const {
  for (const ReadRange& r : ranges) FERRY_RETURN_IF_ERROR(ReadAt(r.offset, r.len, r.dst));
  return Status::Ok();
}

bool IsRemoteName(const std::string& path_or_url) {
  for (const char* scheme : {"http://", "https://", "s3://"}) {
    if (path_or_url.rfind(scheme, 0) == 0) return true;
  }
  return false;
}

Result<std::shared_ptr<ByteSource>> OpenSource(const std::string& path_or_url,
                                               const SourceOptions& options) {
  if (IsRemoteName(path_or_url)) return OpenRemoteSource(path_or_url, options);
  return Error(StatusCode::kUnimplemented, path_or_url,
               ": local files are not read through OpenSource yet");
}

}  // namespace ferry
