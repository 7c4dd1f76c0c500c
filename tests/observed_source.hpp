// A byte source that passes every read on to another and reports each range read to a
// callback: for tests and benchmarks that check what a load fetched (a rank's share of a
// remote object, the bytes a remote load asked for).
#ifndef FERRY_TESTS_OBSERVED_SOURCE_HPP_
#define FERRY_TESTS_OBSERVED_SOURCE_HPP_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "io/source.hpp"

namespace ferry::testing {

class ObservedSource : public ByteSource {
 public:
  // Called for every range read, from the reading thread (several at once: it must be
  // thread-safe), before the read.
  using OnRead = std::function<void(uint64_t offset, uint64_t len)>;

  ObservedSource(std::shared_ptr<ByteSource> inner, OnRead on_read)
      : inner_(std::move(inner)), on_read_(std::move(on_read)) {}
  const std::string& name() const override { return inner_->name(); }
  uint64_t size() const override { return inner_->size(); }
  uint64_t preferred_read_bytes() const override { return inner_->preferred_read_bytes(); }
  int preferred_parallel_reads() const override { return inner_->preferred_parallel_reads(); }
  std::string Describe() const override { return inner_->Describe(); }
  Status ReadAt(uint64_t offset, uint64_t len, uint8_t* dst) const override {
    on_read_(offset, len);
    return inner_->ReadAt(offset, len, dst);
  }
  Status ReadRanges(std::span<const ReadRange> ranges) const override {
    for (const ReadRange& r : ranges) on_read_(r.offset, r.len);
    return inner_->ReadRanges(ranges);
  }

 private:
  std::shared_ptr<ByteSource> inner_;
  OnRead on_read_;
};

}  // namespace ferry::testing

#endif  // FERRY_TESTS_OBSERVED_SOURCE_HPP_
