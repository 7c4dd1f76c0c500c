// Footer and trailer of a file being written (src/format/footer_builder.hpp).
#include "format/footer_builder.hpp"

#include <algorithm>
#include <cstring>
#include <utility>

#include "base/util.hpp"
#include "codec/codec.hpp"
#include "ferry_generated.h"
#include "format/recipe_table.hpp"

namespace ferry::format {

namespace {

using flatbuffers::FlatBufferBuilder;
using flatbuffers::Offset;

Offset<fb::QuantizedComponent> BuildComponent(FlatBufferBuilder& b,
                                              const std::optional<QuantizedComponent>& c) {
  if (!c) return 0;
  auto data = b.CreateString(c->data);
  auto scale = c->scale_inv.empty() ? 0 : b.CreateString(c->scale_inv);
  auto amax = c->amax.empty() ? 0 : b.CreateString(c->amax);
  return fb::CreateQuantizedComponent(b, data, scale, static_cast<fb::ScaleLayout>(c->scale_layout),
                                      amax);
}

Offset<fb::Tensor> BuildTensor(FlatBufferBuilder& b, const TensorRecord& t,
                               std::vector<fb::Chunk>& chunks) {
  auto name = b.CreateString(t.name);
  auto shape = b.CreateVector(t.shape);
  auto sums = b.CreateVector(t.checksums);
  Offset<flatbuffers::Vector<const fb::Chunk*>> ch = 0;
  if (t.encoding != Encoding::kRaw) {
    chunks.clear();
    for (const ChunkRecord& c : t.chunks) {
      chunks.emplace_back(c.offset, c.stored_size, static_cast<fb::ChunkCodec>(c.codec));
    }
    ch = b.CreateVectorOfStructs(chunks);
  }
  Offset<flatbuffers::Vector<int64_t>> gshape = 0, goffset = 0;
  if (!t.global_shape.empty() || !t.shard_offset.empty()) {
    gshape = b.CreateVector(t.global_shape);
    goffset = b.CreateVector(t.shard_offset);
  }
  return fb::CreateTensor(b, name, static_cast<fb::DType>(t.dtype), shape, t.data_offset,
                          t.data_size, t.nbytes, static_cast<fb::Encoding>(t.encoding),
                          t.block_size, sums, ch, gshape, goffset);
}

Offset<fb::QuantizedTensor> BuildQuantized(FlatBufferBuilder& b, const QuantizedTensor& q) {
  auto name = b.CreateString(q.name);
  auto shape = b.CreateVector(q.shape);
  auto row = BuildComponent(b, q.rowwise);
  auto col = BuildComponent(b, q.columnwise);
  return fb::CreateQuantizedTensor(b, name, static_cast<fb::DType>(q.quantized_dtype),
                                   static_cast<fb::DType>(q.logical_dtype), shape,
                                   static_cast<fb::ScalingMode>(q.scaling_mode), row, col);
}

Offset<fb::ScalingState> BuildScaling(FlatBufferBuilder& b, const std::string& module,
                                      const ScalingState& s) {
  std::vector<Offset<fb::DirectionState>> doffs;
  for (const DirectionState& d : s.states) {
    std::vector<uint8_t> roles;
    for (SlotRole r : d.slot_roles) roles.push_back(static_cast<uint8_t>(r));
    auto rv = b.CreateVector(reinterpret_cast<const fb::SlotRole*>(roles.data()), roles.size());
    auto sv = b.CreateVector(d.scale);
    auto hv = b.CreateVector(d.amax_history);
    doffs.push_back(fb::CreateDirectionState(b, static_cast<fb::Direction>(d.direction),
                                             d.num_gemms, rv, sv, hv, d.history_len));
  }
  auto dvec = b.CreateVector(doffs);
  auto mname = b.CreateString(module);
  auto [rtype, roff] = RecipeToTable(b, s.recipe);
  return fb::CreateScalingState(b, mname, rtype, roff, dvec);
}

}  // namespace

Result<std::vector<uint8_t>> BuildFooter(std::vector<const TensorRecord*> tensors,
                                         const FooterExtras& extras, const std::string& path) {
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorRecord* x, const TensorRecord* y) { return x->name < y->name; });
  FlatBufferBuilder b(1 << 16);
  std::vector<Offset<fb::Tensor>> toffs;
  toffs.reserve(tensors.size());
  std::vector<fb::Chunk> chunks;
  for (const TensorRecord* t : tensors) toffs.push_back(BuildTensor(b, *t, chunks));
  auto tvec = b.CreateVector(toffs);

  std::vector<Offset<fb::QuantizedTensor>> qoffs;
  for (const auto& [qname, q] : extras.quantized) qoffs.push_back(BuildQuantized(b, q));
  auto qvec = b.CreateVector(qoffs);

  std::vector<Offset<fb::ScalingState>> soffs;
  for (const auto& [module, s] : extras.scaling) soffs.push_back(BuildScaling(b, module, s));
  auto svec = b.CreateVector(soffs);

  std::vector<Offset<fb::KeyValue>> moffs;
  for (const auto& [k, v] : extras.metadata) {
    auto ko = b.CreateString(k);
    auto vo = b.CreateString(v);
    moffs.push_back(fb::CreateKeyValue(b, ko, vo));
  }
  auto mvec = b.CreateVector(moffs);
  auto prod =
      b.CreateString(extras.producer.empty() ? std::string("tensorferry ") + FERRY_VERSION_STRING
                                             : extras.producer);
  // The tensors holding data, in file order.
  std::vector<uint32_t> order;
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i]->data_size > 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](uint32_t x, uint32_t y) {
    return tensors[x]->data_offset < tensors[y]->data_offset;
  });
  auto ovec = b.CreateVector(order);
  auto root = fb::CreateCheckpoint(b, kFormatVersion, prod, fb::ChecksumAlgo::XXH3_64, tvec, qvec,
                                   svec, mvec, ovec);
  fb::FinishCheckpointBuffer(b, root);
  if (b.GetSize() > kMaxFooterBytes) {
    return Error(StatusCode::kResourceExhausted, path, ": footer of ", b.GetSize(),
                 " bytes exceeds the format's limit of ", kMaxFooterBytes);
  }
  return std::vector<uint8_t>(b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize());
}

std::array<uint8_t, kTrailerSize> MakeTrailer(const std::vector<uint8_t>& footer) {
  std::array<uint8_t, kTrailerSize> trailer;
  const uint64_t size = footer.size();
  const uint64_t sum = Checksum64(footer.data(), footer.size());
  std::memcpy(trailer.data(), &size, 8);
  std::memcpy(trailer.data() + 8, &sum, 8);
  std::memcpy(trailer.data() + 16, kMagic, kMagicSize);
  return trailer;
}

}  // namespace ferry::format
