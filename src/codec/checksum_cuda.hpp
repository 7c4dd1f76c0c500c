// Block checksums (XXH3-64, seed 0: Checksum64) of bytes in CUDA device memory, computed on the
// device on the caller's stream, for blocks whose raw bytes never exist on the host (decoded on
// the device). Built only where the CUDA toolkit is.
#ifndef FERRY_SRC_CODEC_CHECKSUM_CUDA_HPP_
#define FERRY_SRC_CODEC_CHECKSUM_CUDA_HPP_

#ifdef FERRY_HAVE_CUDA

#include <cuda_runtime.h>

#include <cstdint>

#include "ferry/status.hpp"

namespace ferry {

// One block of device memory and the checksum it should have.
struct DeviceBlock {
  const void* data = nullptr;  // device memory, any alignment; unused when size is 0
  uint64_t size = 0;           // bytes, any number
  uint64_t expected = 0;       // Checksum64 of the intended bytes (read by the Verify forms)
};

// The value VerifyOnDevice writes for a block whose checksum differs. Its low four bits are
// all set, which no PLANES decode error value has (planes::DeviceErrorText), so one error array
// can serve both.
inline constexpr uint32_t kChecksumMismatch = 0xFFFFFFFFu;

// Enqueues on `stream` (the caller's current device) the computation of sums[i] =
// Checksum64(blocks[i].data, blocks[i].size) for i in [0, n). `blocks` is host memory, read
// before the call returns; `sums` is device memory for n values, written once the stream
// passes this point. The blocks must stay unchanged until then; nothing outside
// [data, data + size) of any block is read. n == 0 enqueues nothing.
//
// Speed: each block is hashed by one thread block (CTA). XXH3 scrambles its state after every
// KiB, each scramble waiting for the previous one, so one block runs at a small fraction of
// the device's memory bandwidth however it is split (4096 dependent steps per 4 MiB; 64 KiB
// per CTA round trip on top). Only many blocks at once (dozens of 4 MiB blocks or more) keep
// the memory bus busy: hash many blocks per call rather than a few at a time
// (benchmarks/checksum_bench.cu measures both).
//
// Returns InvalidArgument for n < 0, a null `blocks`, `sums`, or data pointer of a nonempty
// block, and CudaError for launch failures. Thread-safe.
Status ChecksumOnDevice(const DeviceBlock* blocks, int n, uint64_t* sums, cudaStream_t stream);

// As ChecksumOnDevice, but compares each sum with blocks[i].expected on the device: once the
// stream passes this point, mismatch[i] holds kChecksumMismatch for every block whose checksum
// differs, unless it held another nonzero value before (an earlier error of that block stays);
// entries of matching blocks are left as they were. `mismatch` is device memory for n values,
// which the caller zeroes beforehand (once, for as many calls as it likes).
Status VerifyOnDevice(const DeviceBlock* blocks, int n, uint32_t* mismatch, cudaStream_t stream);

// The same with the n descriptors in device memory, which the stream must have written by this
// point (a copy from pinned memory on `stream`, say) and keep until it passes it: one launch
// whatever n, where the forms above launch once per 160 blocks (their descriptors travel as
// kernel parameters). Nothing is read on the host, so the descriptors are not checked there: a
// block with a null data pointer and a nonzero size gets ~expected as its sum, and so is a
// mismatch. Same errors otherwise (InvalidArgument for n < 0 or null arrays).
Status ChecksumTableOnDevice(const DeviceBlock* table, int n, uint64_t* sums, cudaStream_t stream);
Status VerifyTableOnDevice(const DeviceBlock* table, int n, uint32_t* mismatch,
                           cudaStream_t stream);

}  // namespace ferry

#endif  // FERRY_HAVE_CUDA
#endif  // FERRY_SRC_CODEC_CHECKSUM_CUDA_HPP_
