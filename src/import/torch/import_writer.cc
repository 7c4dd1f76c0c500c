// TorchCheckpoint -> TensorFerry or safetensors.
#include "import/torch/import_writer.hpp"

#include <algorithm>
#include <map>

#include "base/util.hpp"
#include "format/block_source.hpp"
#include "format/safetensors.hpp"

namespace ferry::torch_import {

namespace {

// Metadata in key order. The caller's entries win over the checkpoint's (a value in the
// pickle named like one of them must not stand in for it), then the first of repeated keys.
std::vector<std::pair<std::string, std::string>> Metadata(const TorchCheckpoint& ck,
                                                          const ImportWriteOptions& o) {
  std::map<std::string, std::string> m;
  for (const auto& [k, v] : o.extra_metadata) m.emplace(k, v);
  for (const auto& [k, v] : ck.metadata()) m.emplace(k, v);
  return {m.begin(), m.end()};
}

Status ToFerry(const TorchCheckpoint& ck, const std::string& out, const ImportWriteOptions& o) {
  FERRY_ASSIGN_OR_RETURN(Writer writer, Writer::Create(out, o.writer));
  for (const ImportedTensor& t : ck.tensors()) {
    FillFn fill = [&](uint64_t offset, void* dst, size_t size) -> Status {
      FERRY_RETURN_IF_ERROR(ck.Read(t, offset, dst, size));
      if (o.progress) o.progress(size);
      return Status::Ok();
    };
    FERRY_RETURN_IF_ERROR(writer.AddTensorFrom(t.name, t.dtype, t.shape, fill, o.writer.encoding));
  }
  for (const ScalingState& s : ck.scaling()) FERRY_RETURN_IF_ERROR(writer.AddScalingState(s));
  for (const auto& [k, v] : Metadata(ck, o)) FERRY_RETURN_IF_ERROR(writer.SetMetadata(k, v));
  return writer.Commit();
}

Status ToSafetensors(const TorchCheckpoint& ck, const std::string& out,
                     const ImportWriteOptions& o) {
  if (!ck.scaling().empty() && !o.scaling_in_metadata) {
    return Error(StatusCode::kUnimplemented, ck.path(), ": holds FP8 scaling state (",
                 ck.scaling().size(),
                 " modules), which safetensors cannot store; convert to a .ferry file");
  }
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, const ImportedTensor*> by_name;
  for (const ImportedTensor& t : ck.tensors()) {
    if (SafetensorsDTypeName(t.dtype) == nullptr) {
      return Error(StatusCode::kUnimplemented, t.source, ": tensor ", Quote(t.name), " is ",
                   DTypeName(t.dtype), ", which safetensors cannot represent");
    }
    by_name.emplace(t.name, &t);
    entries.push_back(SafetensorsEntry{t.name, t.dtype, t.shape});
  }
  SortSafetensorsEntries(&entries);
  FERRY_ASSIGN_OR_RETURN(
      SafetensorsWriter writer,
      SafetensorsWriter::Create(out, entries, Metadata(ck, o), o.writer.durable));
  constexpr uint64_t kPiece = uint64_t{16} << 20;
  std::vector<uint8_t> buf;
  for (const SafetensorsEntry& e : entries) {
    const ImportedTensor& t = *by_name.at(e.name);
    buf.resize(std::min(t.nbytes, kPiece));
    for (uint64_t off = 0; off < t.nbytes; off += kPiece) {
      uint64_t len = std::min(kPiece, t.nbytes - off);
      FERRY_RETURN_IF_ERROR(ck.Read(t, off, buf.data(), len));
      FERRY_RETURN_IF_ERROR(writer.Write(buf.data(), len));
      if (o.progress) o.progress(len);
    }
  }
  return writer.Commit();
}

}  // namespace

Status WriteImported(const TorchCheckpoint& ck, const std::string& out,
                     const ImportWriteOptions& options) {
  FERRY_ASSIGN_OR_RETURN(OutputFormat format, ChooseOutputFormat(out, options.to));
  return format == OutputFormat::kSafetensors ? ToSafetensors(ck, out, options)
                                              : ToFerry(ck, out, options);
}

Status ConvertCheckpoint(const std::string& in, const std::string& out,
                         const WriterOptions& options, std::string_view to) {
  // Before anything is read: a name that says no format is the caller's mistake.
  FERRY_ASSIGN_OR_RETURN(OutputFormat format, ChooseOutputFormat(out, to));
  if (TorchCheckpoint::Recognises(in)) {
    FERRY_ASSIGN_OR_RETURN(auto ck, TorchCheckpoint::Open(in));
    ImportWriteOptions o;
    o.writer = options;
    o.to = std::string(to);
    return WriteImported(*ck, out, o);
  }
  if (format == OutputFormat::kSafetensors) {
    return Error(StatusCode::kUnimplemented, in,
                 ": writing safetensors from this input is `ferry convert`'s job");
  }
  FERRY_ASSIGN_OR_RETURN(auto reader, Reader::Open(in));
  const BlockSource& blocks = BlocksOf(*reader);
  ReadPath verified;
  verified.verify = true;
  FERRY_ASSIGN_OR_RETURN(Writer writer, Writer::Create(out, options));
  for (size_t i = 0; i < reader->num_tensors(); ++i) {
    TensorInfo info = reader->tensor(i);
    FillFn fill = [&](uint64_t offset, void* dst, size_t size) -> Status {
      return blocks.Read(i, offset, size, static_cast<uint8_t*>(dst), verified);
    };
    FERRY_RETURN_IF_ERROR(
        writer.AddTensorFrom(info.name, info.dtype, info.shape, fill, options.encoding));
    if (!info.global_shape.empty()) {
      FERRY_RETURN_IF_ERROR(writer.SetGlobalSlice(info.name, info.global_shape, info.shard_offset));
    }
  }
  for (const QuantizedTensor& q : reader->quantized())
    FERRY_RETURN_IF_ERROR(writer.AddQuantized(q));
  for (const ScalingState& s : reader->scaling_states()) {
    FERRY_RETURN_IF_ERROR(writer.AddScalingState(s));
  }
  for (const auto& [k, v] : reader->metadata()) FERRY_RETURN_IF_ERROR(writer.SetMetadata(k, v));
  return writer.Commit();
}

}  // namespace ferry::torch_import
