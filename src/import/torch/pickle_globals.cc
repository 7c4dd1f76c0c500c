// The allow-list of the pickle interpreter: the torch dtypes and storage classes, the
// record-only classes and constants, and the globals each name resolves to.
#include <optional>
#include <string>
#include <string_view>

#include "base/util.hpp"
#include "format/recipe.hpp"
#include "import/torch/pickle_machine.hpp"
#include "import/torch/unpickle.hpp"

namespace ferry::torch_import {

namespace {

struct DTypeRow {
  const char* name;
  const char* alias;    // torch's other name for it, or ""
  const char* storage;  // legacy storage class, or ""
  std::optional<DType> dtype;
  int itemsize;
};

// Every dtype torch.save can name. Those without a TensorFerry type are listed so that the
// error says which dtype a tensor has instead of calling it unknown.
const DTypeRow kDTypes[] = {
    {"float32", "float", "FloatStorage", DType::kF32, 4},
    {"float64", "double", "DoubleStorage", DType::kF64, 8},
    {"float16", "half", "HalfStorage", DType::kF16, 2},
    {"bfloat16", "", "BFloat16Storage", DType::kBF16, 2},
    {"int8", "", "CharStorage", DType::kI8, 1},
    {"int16", "short", "ShortStorage", DType::kI16, 2},
    {"int32", "int", "IntStorage", DType::kI32, 4},
    {"int64", "long", "LongStorage", DType::kI64, 8},
    {"uint8", "", "ByteStorage", DType::kU8, 1},
    {"uint16", "", "", DType::kU16, 2},
    {"uint32", "", "", DType::kU32, 4},
    {"uint64", "", "", DType::kU64, 8},
    {"bool", "", "BoolStorage", DType::kBool, 1},
    {"complex64", "cfloat", "ComplexFloatStorage", DType::kC64, 8},
    {"complex128", "cdouble", "ComplexDoubleStorage", DType::kC128, 16},
    {"float8_e4m3fn", "", "", DType::kF8_E4M3FN, 1},
    {"float8_e5m2", "", "", DType::kF8_E5M2, 1},
    {"float8_e4m3fnuz", "", "", DType::kF8_E4M3FNUZ, 1},
    {"float8_e5m2fnuz", "", "", DType::kF8_E5M2FNUZ, 1},
    {"float8_e8m0fnu", "", "", DType::kF8_E8M0FNU, 1},
    {"float4_e2m1fn_x2", "", "", DType::kF4_E2M1FN, 1},
    {"complex32", "chalf", "", std::nullopt, 4},
    {"qint8", "", "QInt8Storage", std::nullopt, 1},
    {"quint8", "", "QUInt8Storage", std::nullopt, 1},
    {"qint32", "", "QInt32Storage", std::nullopt, 4},
    {"quint4x2", "", "QUInt4x2Storage", std::nullopt, 1},
    {"quint2x4", "", "QUInt2x4Storage", std::nullopt, 1},
    {"bits1x8", "", "", std::nullopt, 1},
    {"bits2x4", "", "", std::nullopt, 1},
    {"bits4x2", "", "", std::nullopt, 1},
    {"bits8", "", "", std::nullopt, 1},
    {"bits16", "", "", std::nullopt, 2},
};

TorchDType FromRow(const DTypeRow& r) {
  TorchDType t;
  t.name = r.name;
  t.dtype = r.dtype;
  t.itemsize = r.itemsize;
  t.packed_x2 = std::string_view(r.name) == "float4_e2m1fn_x2";
  return t;
}

// Record-only classes: never instantiated, their arguments and state kept as values. The
// recipe classes (format::RecipeNamed) are records too.
const char* const kRecordClasses[] = {
    "transformer_engine.common.recipe.Format",
    "transformer_engine.common.recipe._FormatHelper",
    "transformer_engine.common.recipe._FormatHelperFP4",
    "transformer_engine.common.recipe._OverrideLinearPrecision",
    "transformer_engine.common.recipe.QParams",
    "transformer_engine.common.recipe.MMParams",
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint._extension.ExtensionRegistry",
    "torch.device",
    // torch.layout pickles as _get_layout("torch.strided") (DCP's TensorProperties).
    "torch.serialization._get_layout",
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
    "pathlib._local.PosixPath",
    "pathlib._local.PurePosixPath",
};

const char* const kConstants[] = {
    "torch.strided",       "torch.sparse_coo",      "torch.contiguous_format",
    "torch.channels_last", "torch.preserve_format", "torch.channels_last_3d",
};

}  // namespace

std::optional<TorchDType> TorchDTypeByName(std::string_view name) {
  for (const DTypeRow& r : kDTypes) {
    if (name == r.name || (*r.alias && name == r.alias)) return FromRow(r);
  }
  return std::nullopt;
}

std::optional<TorchDType> TorchDTypeByStorage(std::string_view name) {
  if (name == "UntypedStorage" || name == "TypedStorage") return FromRow(kDTypes[8]);  // uint8
  for (const DTypeRow& r : kDTypes) {
    if (*r.storage && name == r.storage) return FromRow(r);
  }
  return std::nullopt;
}

namespace pickle {

std::optional<Global> Resolve(std::string_view module, std::string_view name) {
  std::string full = StrCat(module, ".", name);
  struct Named {
    const char* name;
    Global g;
  };
  static const Named kNamed[] = {
      {"collections.OrderedDict", Global::kOrderedDict},
      {"torch._utils._rebuild_tensor", Global::kRebuildTensor},
      {"torch._utils._rebuild_tensor_v2", Global::kRebuildTensorV2},
      {"torch._utils._rebuild_tensor_v3", Global::kRebuildTensorV3},
      {"torch._utils._rebuild_parameter", Global::kRebuildParameter},
      {"torch._utils._rebuild_parameter_with_state", Global::kRebuildParameterWithState},
      {"torch._tensor._rebuild_from_type_v2", Global::kRebuildFromTypeV2},
      {"torch.Size", Global::kTorchSize},
      {"_codecs.encode", Global::kCodecsEncode},
      {"builtins.bytearray", Global::kBytearray},
      {"builtins.set", Global::kSet},
      {"builtins.frozenset", Global::kFrozenset},
      {"torch.storage._load_from_bytes", Global::kLoadFromBytes},
      {"_io.BytesIO", Global::kBytesIO},
      {"io.BytesIO", Global::kBytesIO},
      {"torch.Tensor", Global::kTensorClass},
      {"torch._tensor.Tensor", Global::kTensorClass},
      {"torch.nn.parameter.Parameter", Global::kTensorClass},
  };
  for (const Named& n : kNamed) {
    if (full == n.name) return n.g;
  }
  for (const char* c : kRecordClasses) {
    if (full == c) return Global::kRecord;
  }
  for (const char* c : kConstants) {
    if (full == c) return Global::kConstant;
  }
  if (module == "transformer_engine.common.recipe" && name != "none" && format::RecipeNamed(name)) {
    return Global::kRecord;
  }
  // Enum members pickled by qualified name (Format.E4M3) when their value does not pickle.
  if (module == "transformer_engine.common.recipe" && name.starts_with("Format.") &&
      (format::Fp8FormatNamed(name.substr(7)) || name == "Format.E2M1")) {
    return Global::kRecord;
  }
  if (module == "torch" && TorchDTypeByName(name)) return Global::kDtype;
  if ((module == "torch" || module == "torch.storage") && TorchDTypeByStorage(name)) {
    return Global::kStorageType;
  }
  return std::nullopt;
}

}  // namespace pickle

}  // namespace ferry::torch_import
