// Where a save writes when its destination is an object store: bytes appended in order,
// uploaded as they come, and made visible only by Commit. An S3 sink uploads parts of
// part_bytes (>= 5 MiB) through a multipart upload while the writer produces the next ones,
// and CompleteMultipartUpload is sent by Commit alone; Abort (or destruction before Commit,
// or a failure) sends AbortMultipartUpload. A save killed mid-way leaves only an unfinished
// upload (which a bucket lifecycle rule reclaims), never a partial object: the previous
// object stays in place. Objects smaller than one part go up as one PutObject at Commit.
//
// Thread safety: one thread at a time calls a sink's methods (parts upload on the sink's
// own thread). Lifetime: owned by the caller; destruction aborts an uncommitted upload.
#ifndef FERRY_SRC_IO_REMOTE_SINK_HPP_
#define FERRY_SRC_IO_REMOTE_SINK_HPP_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "ferry/status.hpp"
#include "io/aws_config.hpp"
#include "io/http_client.hpp"

namespace ferry {

class RemoteSink {
 public:
  virtual ~RemoteSink() = default;
  // "s3://bucket/key": never with credentials.
  virtual const std::string& name() const = 0;
  // Appends bytes. The first upload error is returned here (or by Commit) and sticks.
  virtual Status Append(const uint8_t* data, size_t size) = 0;
  // Uploads what remains and makes the object visible, replacing any previous one. After an
  // error the upload is aborted and the previous object is left in place.
  virtual Status Commit() = 0;
  // Abandons the upload (best effort; no error): the previous object stays.
  virtual void Abort() = 0;
};

struct S3SinkOptions {
  uint64_t part_bytes = uint64_t{8} << 20;  // at least 5 MiB (S3's smallest part but the last)
  int parts_in_flight = 4;  // parts uploading or queued at once: memory is this many parts
  HttpOptions http;
};

// An upload of the object an s3:// URL names. InvalidArgument for a bad URL or part size.
// Nothing is sent until the first part is full (or Commit).
Result<std::unique_ptr<RemoteSink>> OpenS3Sink(const std::string& url, const AwsSettings& settings,
                                               const S3SinkOptions& options);

// OpenS3Sink with the settings of the environment and shared AWS files (aws_config.hpp).
// InvalidArgument for a URL that is not s3:// (plain HTTP servers take no uploads).
Result<std::unique_ptr<RemoteSink>> OpenRemoteSink(const std::string& url);

}  // namespace ferry

#endif  // FERRY_SRC_IO_REMOTE_SINK_HPP_
