// TransformerEngine's `_extra_state` entries, read as data. TransformerEngine has stored a
// module's FP8 state in four shapes over its versions, all handled here:
// - a uint8 tensor holding pickle.dumps(dict) (2.x; the dict's tensors are CPU tensors, and
//   plain pickle stores each storage as torch.storage._load_from_bytes(<legacy torch.save>));
// - the same with the tensors left on the GPU (the original bug: unpickling them touches the
//   GPU they were saved from); here the device is read and ignored;
// - an io.BytesIO holding torch.save(dict) output (1.x);
// - the dict itself, with CUDA tensors, in the state_dict; an empty uint8 tensor or None
//   when the module keeps no state.
// The dict: "recipe" (a recipe dataclass, read as field values, never instantiated),
// "scale_fwd" F32[S], "amax_history_fwd" F32[L, S], "scale_bwd", "amax_history_bwd",
// "extra_fp8_variables" (plain values, kept as JSON metadata under
// kExtraVariablesKeyPrefix + module). S is 3 x num_gemms forward (input, weight, output per
// GEMM) and 2 x num_gemms backward (grad_output, grad_input).
#ifndef FERRY_SRC_IMPORT_TORCH_TE_EXTRA_STATE_HPP_
#define FERRY_SRC_IMPORT_TORCH_TE_EXTRA_STATE_HPP_

#include <string>
#include <utility>
#include <vector>

#include "ferry/ferry.hpp"
#include "import/torch/unpickle.hpp"
#include "io/io.hpp"

namespace ferry::torch_import {

inline constexpr char kExtraVariablesKeyPrefix[] = "transformer_engine.extra_fp8_variables.";

class WalkBudget;  // torch_checkpoint.hpp

// Decodes the extra state `v` of `module`. `mapping` is the file its tensors lie in (may be
// null). Appends to `metadata` the module's extra_fp8_variables, when it has any. What it
// decodes and builds (pickled bytes, scale and history tables, the variables' JSON) is taken
// from `budget` before it is allocated, so an extra state shared by many modules, or tables
// that are broadcast views of a few bytes, cost what they produce.
Result<ScalingState> DecodeExtraState(Heap* heap, const Value* v, const std::string& module,
                                      const Mapping* mapping, const std::string& where,
                                      std::vector<std::pair<std::string, std::string>>* metadata,
                                      WalkBudget* budget);

}  // namespace ferry::torch_import

#endif  // FERRY_SRC_IMPORT_TORCH_TE_EXTRA_STATE_HPP_
