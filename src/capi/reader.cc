// ferry_reader_t: open, describe, view and read one checkpoint file.

#include <algorithm>
#include <cstdlib>

#include "capi/internal.hpp"
#include "format/block_source.hpp"
#include "io/io.hpp"

using namespace ferry::capi;  // NOLINT(build/namespaces): the entry points are shells over these

namespace {

// One pass over the footer's tensor tables (no per-tensor heap objects): sizes first, so
// the three arrays are allocated once.
std::unique_ptr<TensorTable> BuildTable(const ferry::Reader& reader) {
  const ferry::BlockSource& r = ferry::BlocksOf(reader);
  const size_t n = r.size();
  auto t = std::make_unique<TensorTable>();
  uint64_t name_bytes = 0, dims = 0;
  for (size_t i = 0; i < n; ++i) {
    const ferry::TensorRecord x = r.Record(i);
    name_bytes += x.name.size() + 1;
    dims += x.shape.size();
  }
  t->records.resize(n);
  t->names.resize(name_bytes);
  t->shapes.resize(dims);
  uint64_t name_at = 0, dim_at = 0, packed = 0;
  for (size_t i = 0; i < n; ++i) {
    const ferry::TensorRecord x = r.Record(i);
    ferry_tensor_record_t& rec = t->records[i];
    std::memcpy(t->names.data() + name_at, x.name.data(), x.name.size());
    t->names[name_at + x.name.size()] = '\0';
    rec.name_offset = name_at;
    rec.name_size = x.name.size();
    name_at += x.name.size() + 1;
    rec.shape_offset = dim_at;
    std::copy(x.shape.begin(), x.shape.end(), t->shapes.begin() + dim_at);
    rec.ndim = static_cast<int32_t>(x.shape.size());
    dim_at += x.shape.size();
    rec.nbytes = x.nbytes;
    rec.data_offset = x.data_offset;
    rec.data_size = x.data_size;
    rec.block_size = x.block_size;
    rec.dtype = static_cast<int32_t>(x.dtype);
    rec.encoding = static_cast<int32_t>(x.encoding);
    rec.reserved = 0;
    // Sizes are validated at open (each tensor lies inside the file), so the sum of aligned
    // sizes cannot overflow.
    rec.packed_offset = packed;
    packed += ferry::AlignUp(rec.nbytes, FERRY_PACKED_ALIGNMENT);
  }
  t->packed_bytes = packed;
  return t;
}

void FillInfo(const TensorTable& table, size_t index, ferry_tensor_info_t* out) {
  const ferry_tensor_record_t& rec = table.records[index];
  ferry_tensor_info_t full;
  full.struct_size = sizeof(full);
  full.name = table.names.data() + rec.name_offset;
  full.dtype = rec.dtype;
  full.ndim = rec.ndim;
  full.shape = rec.ndim == 0 ? nullptr : table.shapes.data() + rec.shape_offset;
  full.nbytes = rec.nbytes;
  full.data_offset = rec.data_offset;
  full.data_size = rec.data_size;
  full.encoding = rec.encoding;
  full.block_size = rec.block_size;
  full.index = index;
  FillSized(full, out);
}

ferry::ReadOptions ReadFlags(uint32_t flags) {
  ferry::ReadOptions o;
  o.verify = (flags & FERRY_READ_VERIFY) != 0;
  return o;
}

}  // namespace

namespace ferry::capi {

std::unique_ptr<ferry_reader_t> WrapReader(std::shared_ptr<ferry::Reader> reader) {
  auto h = std::make_unique<ferry_reader_t>();
  h->reader = std::move(reader);
  const ferry::Reader& rd = *h->reader;
  h->producer = rd.producer();
  h->num_tensors = rd.num_tensors();
  h->metadata = rd.metadata();
  for (const ferry::ScalingState& s : rd.scaling_states()) h->scaling.push_back(ToCScaling(s));
  return h;
}

int ToReaderOptions(const ferry_reader_options_t* options, const char* fn, ferry::ReaderOptions* o,
                    ferry_error_t* error) {
  if (options == nullptr) return FERRY_OK;
  if (!FERRY_C_HAS(options, verify_on_open)) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(fn, ": options->struct_size is not set"));
  }
  o->verify_on_open = options->verify_on_open != 0;
  ferry::StorageOptions& storage = o->storage;
  if (FERRY_C_HAS(options, ca_bundle) && options->ca_bundle != nullptr) {
    storage.ca_bundle = options->ca_bundle;
  }
  if (FERRY_C_HAS(options, max_attempts)) storage.max_attempts = options->max_attempts;
  if (FERRY_C_HAS(options, max_in_flight)) storage.max_in_flight = options->max_in_flight;
  if (FERRY_C_HAS(options, piece_bytes)) storage.piece_bytes = options->piece_bytes;
  return FERRY_OK;
}

const TensorTable& Table(const ferry_reader_t* reader) {
  std::call_once(reader->table_once, [reader] { reader->table = BuildTable(*reader->reader); });
  return *reader->table;
}

}  // namespace ferry::capi

extern "C" {

void ferry_reader_options_init(ferry_reader_options_t* options) {
  if (options == nullptr) return;
  std::memset(static_cast<void*>(options), 0, sizeof(*options));
  options->struct_size = sizeof(*options);
  options->verify_on_open = 0;
}

int ferry_reader_open(const char* path, const ferry_reader_options_t* options, ferry_reader_t** out,
                      ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(path);
    FERRY_C_REQUIRE(out);
    return OpenWithOptions(
        path, options, fn, error,
        [](const char* p, const ferry::ReaderOptions& o) { return ferry::Reader::Open(p, o); },
        [&](std::shared_ptr<ferry::Reader> r) { *out = WrapReader(std::move(r)).release(); });
  });
}

void ferry_reader_free(ferry_reader_t* reader) { delete reader; }

const char* ferry_reader_path(const ferry_reader_t* reader) {
  return reader == nullptr ? "" : reader->reader->path().c_str();
}

uint64_t ferry_reader_file_size(const ferry_reader_t* reader) {
  return reader == nullptr ? 0 : reader->reader->file_size();
}

uint32_t ferry_reader_format_version(const ferry_reader_t* reader) {
  return reader == nullptr ? 0 : reader->reader->format_version();
}

const char* ferry_reader_producer(const ferry_reader_t* reader) {
  return reader == nullptr ? "" : reader->producer.c_str();
}

size_t ferry_reader_num_tensors(const ferry_reader_t* reader) {
  return reader == nullptr ? 0 : reader->num_tensors;
}

int ferry_reader_tensor_info(const ferry_reader_t* reader, size_t index, ferry_tensor_info_t* info,
                             ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(info);
    if (index >= reader->num_tensors) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(reader->reader->path(), ": tensor index ", index, " out of range (",
                                reader->num_tensors, " tensors)"));
    }
    FillInfo(Table(reader), index, info);
    return FERRY_OK;
  });
}

int ferry_reader_tensor_table(const ferry_reader_t* reader, ferry_tensor_table_t* table,
                              ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(table);
    if (int rc = CheckSized(table, fn, "table", error); rc != FERRY_OK) return rc;
    const TensorTable& t = Table(reader);
    ferry_tensor_table_t full;
    full.struct_size = sizeof(full);
    full.num_tensors = t.records.size();
    full.record_size = sizeof(ferry_tensor_record_t);
    full.records = t.records.data();
    full.names = t.names.data();
    full.names_size = t.names.size();
    full.shapes = t.shapes.data();
    full.num_shape_entries = t.shapes.size();
    full.packed_bytes = t.packed_bytes;
    FillSized(full, table);
    return FERRY_OK;
  });
}

int ferry_reader_find_tensor(const ferry_reader_t* reader, const char* name,
                             ferry_tensor_info_t* info, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(name);
    FERRY_C_REQUIRE(info);
    auto found = reader->reader->Find(name);
    if (!found.ok()) return Report(found.status(), error);
    FillInfo(Table(reader), found->index, info);
    return FERRY_OK;
  });
}

size_t ferry_reader_num_metadata(const ferry_reader_t* reader) {
  return reader == nullptr ? 0 : reader->metadata.size();
}

int ferry_reader_metadata_at(const ferry_reader_t* reader, size_t index, const char** key,
                             const char** value, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    if (index >= reader->metadata.size()) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(reader->reader->path(), ": metadata index ", index,
                                " out of range (", reader->metadata.size(), " entries)"));
    }
    if (key != nullptr) *key = reader->metadata[index].first.c_str();
    if (value != nullptr) *value = reader->metadata[index].second.c_str();
    return FERRY_OK;
  });
}

int ferry_reader_metadata_entry(const ferry_reader_t* reader, size_t index, const char** key,
                                size_t* key_size, const char** value, size_t* value_size,
                                ferry_error_t* error) {
  int rc = ferry_reader_metadata_at(reader, index, key, value, error);
  if (rc != FERRY_OK) return rc;
  if (key_size != nullptr) *key_size = reader->metadata[index].first.size();
  if (value_size != nullptr) *value_size = reader->metadata[index].second.size();
  return FERRY_OK;
}

int ferry_reader_metadata_get(const ferry_reader_t* reader, const char* key, const char** value,
                              ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(key);
    FERRY_C_REQUIRE(value);
    const auto& md = reader->metadata;
    auto it = std::lower_bound(md.begin(), md.end(), std::string_view(key),
                               [](const auto& kv, std::string_view k) { return kv.first < k; });
    if (it == md.end() || it->first != key) {
      return Fail(error, FERRY_NOT_FOUND,
                  ferry::StrCat(reader->reader->path(), ": no metadata key ", ferry::Quote(key)));
    }
    *value = it->second.c_str();
    return FERRY_OK;
  });
}

size_t ferry_reader_num_scaling_states(const ferry_reader_t* reader) {
  return reader == nullptr ? 0 : reader->scaling.size();
}

int ferry_reader_scaling_state_at(const ferry_reader_t* reader, size_t index,
                                  ferry_scaling_state_t* state, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(state);
    if (index >= reader->scaling.size()) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(reader->reader->path(), ": scaling state index ", index,
                                " out of range (", reader->scaling.size(), " states)"));
    }
    FillScaling(*reader->scaling[index], state);
    return FERRY_OK;
  });
}

int ferry_reader_find_scaling_state(const ferry_reader_t* reader, const char* module,
                                    ferry_scaling_state_t* state, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(module);
    FERRY_C_REQUIRE(state);
    for (const auto& s : reader->scaling) {
      if (s->module == module) {
        FillScaling(*s, state);
        return FERRY_OK;
      }
    }
    return Fail(error, FERRY_NOT_FOUND,
                ferry::StrCat(reader->reader->path(), ": no scaling state for module ",
                              ferry::Quote(module)));
  });
}

namespace {
// Tensor `info` of `reader` copied into host memory: what ferry_reader_view hands out where
// the file is not mapped.
ferry::Result<std::shared_ptr<void>> HostCopy(const ferry::Reader& reader,
                                              const ferry::TensorInfo& info,
                                              ferry::ReadOptions options) {
  if (info.nbytes == 0) return std::shared_ptr<void>();
  void* p = std::aligned_alloc(64, ferry::AlignUp(info.nbytes, 64));
  if (p == nullptr) {
    return ferry::Error(ferry::StatusCode::kResourceExhausted, reader.path(), ": tensor ",
                        ferry::Quote(info.name), ": allocating ", info.nbytes, " bytes");
  }
  std::shared_ptr<void> copy(p, std::free);
  FERRY_RETURN_IF_ERROR(reader.ReadInto(info.name, p, info.nbytes, options));
  return copy;
}
}  // namespace

int ferry_reader_view(const ferry_reader_t* reader, const char* name, uint32_t flags,
                      DLManagedTensorVersioned** out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(name);
    FERRY_C_REQUIRE(out);
    DLDevice dev;
    dev.device_type = kDLCPU;
    dev.device_id = 0;
    // A file read without a mapping (a network file system) has nothing to view: a raw
    // tensor comes as a copy, which a write cannot carry to the file either. Encoded tensors
    // get the view's own refusal below.
    if (ferry::BlocksOf(*reader->reader).mapping() == nullptr) {
      auto info = reader->reader->Find(name);
      if (!info.ok()) return Report(info.status(), error);
      if (info->encoding == ferry::Encoding::kRaw) {
        auto copy = HostCopy(*reader->reader, *info, ReadFlags(flags));
        if (!copy.ok()) return Report(copy.status(), error);
        *out = MakeManaged(*info, copy->get(), dev, 0, *copy);
        return FERRY_OK;
      }
    }
    auto view = reader->reader->View(name, ReadFlags(flags));
    if (!view.ok()) return Report(view.status(), error);
    // Consumers may ignore DLPack's read-only flag (torch does) and write: the reader's own
    // mapping is read-only (a write would fault) and shared (it would reach the file). The view
    // maps its bytes again, privately: a write copies the page into this process.
    std::shared_ptr<ferry::PrivateRegion> region;
    if (view->nbytes > 0) {
      const ferry::Mapping& file = *ferry::BlocksOf(*reader->reader).mapping();
      auto mapped = ferry::PrivateRegion::Map(file, view->info.data_offset, view->nbytes);
      if (!mapped.ok()) return Report(mapped.status(), error);
      region = std::move(*mapped);
    }
    void* data = region ? region->data() : nullptr;
    *out = MakeManaged(view->info, data, dev, 0, std::move(region));
    return FERRY_OK;
  });
}

int ferry_reader_view_file(const ferry_reader_t* reader, DLManagedTensorVersioned** out,
                           ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(out);
    // Private, as in ferry_reader_view: consumers may write whatever the read-only flag says.
    const auto& mapping = ferry::BlocksOf(*reader->reader).mapping();
    if (!mapping) {
      return Fail(error, FERRY_UNIMPLEMENTED,
                  ferry::StrCat(reader->reader->path(), ": not a mapped local file"));
    }
    const ferry::Mapping& file = *mapping;
    auto mapped = ferry::PrivateRegion::Map(file, 0, file.size());
    if (!mapped.ok()) return Report(mapped.status(), error);
    ferry::TensorInfo info;
    info.name = reader->reader->path();
    info.dtype = ferry::DType::kU8;
    info.shape = {static_cast<int64_t>(file.size())};
    info.nbytes = file.size();
    DLDevice dev;
    dev.device_type = kDLCPU;
    dev.device_id = 0;
    void* data = (*mapped)->data();
    *out = MakeManaged(info, data, dev, 0, std::move(*mapped));
    return FERRY_OK;
  });
}

int ferry_reader_read_into(const ferry_reader_t* reader, const char* name, void* dst,
                           uint64_t dst_size, uint32_t flags, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(name);
    // A NULL destination must not reach the copy (dst_size alone cannot tell).
    if (dst == nullptr && dst_size > 0) return NullArg(error, fn, "dst");
    return Report(reader->reader->ReadInto(name, dst, dst_size, ReadFlags(flags)), error);
  });
}

int ferry_reader_read_rows_into(const ferry_reader_t* reader, const char* name, int64_t row_begin,
                                int64_t row_end, void* dst, uint64_t dst_size, uint32_t flags,
                                ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    FERRY_C_REQUIRE(name);
    // A NULL destination must not reach the copy (dst_size alone cannot tell).
    if (dst == nullptr && dst_size > 0) return NullArg(error, fn, "dst");
    return Report(
        reader->reader->ReadRowsInto(name, row_begin, row_end, dst, dst_size, ReadFlags(flags)),
        error);
  });
}

int ferry_reader_verify(const ferry_reader_t* reader, const char* name, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(reader);
    return Report(name == nullptr ? reader->reader->VerifyAll() : reader->reader->Verify(name),
                  error);
  });
}

}  // extern "C"
