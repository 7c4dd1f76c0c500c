// The device side of a save: a device tensor's bytes are copied into host staging memory on
// the caller's stream, each copy followed by an event that the writer's workers wait for
// before they read the bytes. Device tensors of one save are on one device: the caller's
// current device, in its context, which the workers make current before their first CUDA
// call (the runtime would otherwise make device 0's primary context current).
//
// Thread safety: Bind, Copy, RecordTail and WaitAll are called by the writer's caller, one
// thread at a time. BindWorker, WaitCopy and Recycle may be called from any number of worker
// threads at once, for events that Copy returned.
#ifndef FERRY_SRC_SAVE_DEVICE_SNAPSHOT_HPP_
#define FERRY_SRC_SAVE_DEVICE_SNAPSHOT_HPP_

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cuda/event_pool.hpp"
#include "ferry/ferry.hpp"

namespace ferry {

class DeviceSnapshot {
 public:
  // `path` names the save in messages.
  explicit DeviceSnapshot(std::string path) : path_(std::move(path)) {}
  // Every copy must have been waited for: the events go with the snapshot.
  ~DeviceSnapshot() = default;
  DeviceSnapshot(const DeviceSnapshot&) = delete;
  DeviceSnapshot& operator=(const DeviceSnapshot&) = delete;

  // Checks that `data` (`nbytes`) is memory of the current device, and that the device and
  // context are those of the save's earlier device tensors (the first one decides).
  // `where` names the tensor. Unimplemented in a build without CUDA.
  Status Bind(const std::string& where, const void* data, uint64_t nbytes);
  // Enqueues the copy of `n` bytes from device `src` into pinned host `dst` on `stream`, and
  // an event after it; returns the event. On failure the copy, if enqueued, has completed.
  // `where` and `offset` (the tensor and the byte the copy starts at) are for messages.
  Result<void*> Copy(void* dst, const void* src, uint64_t n, Stream stream,
                     const std::string& where, uint64_t offset);
  // Marks the end of the copies enqueued on `stream` so far (WaitAll waits for it).
  Status RecordTail(Stream stream);
  // Waits until every copy enqueued so far has completed.
  Status WaitAll();

  // Makes the save's context current on a worker thread; `*bound` (null at the thread's start)
  // remembers what that thread already has.
  void BindWorker(void** bound) const;
  // Waits for a copy's event; `tensor` is named in the message of a failed copy.
  Status WaitCopy(void* event, std::string_view tensor);
  // Hands a waited-for event back for the next copy.
  void Recycle(void* event);

 private:
  const std::string path_;
  void* ctx_ = nullptr;  // CUcontext of the device tensors (captured at the first one)
  int device_ = -1;
  EventPool events_;  // in the device tensors' context
  // Per stream, an event recorded after the newest copy: WaitAll waits on these.
  std::vector<std::pair<Stream, void*>> tails_;
};

}  // namespace ferry

#endif  // FERRY_SRC_SAVE_DEVICE_SNAPSHOT_HPP_
