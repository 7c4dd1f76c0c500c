// Remote sources (http://, https://, s3://): implemented in remote_source.cc where libcurl is
// found, and in remote_none.cc (Unimplemented) in builds without it (FERRY_REMOTE=OFF).
#ifndef FERRY_SRC_IO_REMOTE_HPP_
#define FERRY_SRC_IO_REMOTE_HPP_

#include <memory>
#include <string>

#include "io/source.hpp"

namespace ferry {

Result<std::shared_ptr<ByteSource>> OpenRemoteSource(const std::string& url,
                                                     const SourceOptions& options);

}  // namespace ferry

#endif  // FERRY_SRC_IO_REMOTE_HPP_
