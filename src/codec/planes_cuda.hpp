// The PLANES decoder on a CUDA device: blocks already in device memory expand straight into
// their destination, on the caller's stream. Built only where the CUDA toolkit is.
#ifndef FERRY_SRC_CODEC_PLANES_CUDA_HPP_
#define FERRY_SRC_CODEC_PLANES_CUDA_HPP_

#ifdef FERRY_HAVE_CUDA

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "codec/planes.hpp"
#include "ferry/status.hpp"

namespace ferry::planes {

// One block to expand. `layout` comes from Parse over the very bytes at `src` (parsed on the
// host, from the staging copy that was then copied to the device), so the kernel trusts the
// header and tables and checks only the unit contents.
struct DeviceJob {
  const uint8_t* src = nullptr;  // device memory, 16-byte aligned
  uint8_t* dst = nullptr;        // device memory, layout.raw_size bytes
  Layout layout;
};

// Enqueues the decode of jobs[0..n) on `stream` (the caller's current device). `errors` is
// device memory for n uint32 values that hold zero when the decode runs (the caller clears
// them once, for as many decodes as it likes); once the stream passes this point
// errors[i] != 0 says block i is corrupt (DeviceErrorText explains the value). No read or
// write leaves the blocks' extents, whatever their contents. Returns an error only for launch
// failures and misaligned inputs. Thread-safe.
Status DecodeOnDevice(const DeviceJob* jobs, int n, uint32_t* errors, cudaStream_t stream);

// Loads the decode kernel on the current device and sets its shared-memory limit, which the
// first DecodeOnDevice on a device does otherwise (under lazy module loading, the kernel's
// module is loaded then). Idempotent per device; thread-safe.
Status PrepareDevice();

// "unit U of plane K: <what>" for a nonzero device error value.
std::string DeviceErrorText(uint32_t code);

}  // namespace ferry::planes

#endif  // FERRY_HAVE_CUDA
#endif  // FERRY_SRC_CODEC_PLANES_CUDA_HPP_
