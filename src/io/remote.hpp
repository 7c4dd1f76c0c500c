// Sources reached over the network: http:// and https:// URLs, s3:// objects. OpenSource
// (source.hpp) sends every name IsRemoteName accepts here. One definition is linked in:
// remote_none.cc in builds without an HTTP client, which refuses every URL.
#ifndef FERRY_SRC_IO_REMOTE_HPP_
#define FERRY_SRC_IO_REMOTE_HPP_

#include <memory>
#include <string>

#include "ferry/status.hpp"
#include "io/source.hpp"

namespace ferry {

// Opens `url` (http://, https:// or s3://): its size and identity are fixed at open, and
// every later read sees those bytes or fails with DataLoss. NotFound for a missing object;
// Unimplemented where this build reads no remote storage.
Result<std::shared_ptr<ByteSource>> OpenRemoteSource(const std::string& url,
                                                     const SourceOptions& options);

}  // namespace ferry

#endif  // FERRY_SRC_IO_REMOTE_HPP_
