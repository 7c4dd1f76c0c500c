// FP8 recipes and scaling state between their C structs and ferry::ScalingState.

#include "capi/internal.hpp"

using namespace ferry::capi;  // NOLINT(build/namespaces): the entry points are shells over these

namespace {

// The C++ recipe of a checked C recipe; false for an unknown kind.
bool RecipeOf(const ferry_recipe_t& c, ferry::Recipe* out) {
  auto fmt = static_cast<ferry::Fp8Format>(c.fp8_format);
  switch (c.kind) {
    case FERRY_RECIPE_NONE:
      *out = std::monostate{};
      return true;
    case FERRY_RECIPE_DELAYED_SCALING: {
      ferry::DelayedScaling r;
      r.margin = c.margin;
      r.fp8_format = fmt;
      r.amax_history_len = c.amax_history_len;
      r.amax_compute_algo = static_cast<ferry::AmaxComputeAlgo>(c.amax_compute_algo);
      r.reduce_amax = c.reduce_amax != 0;
      r.fp8_dpa = c.fp8_dpa != 0;
      r.fp8_mha = c.fp8_mha != 0;
      *out = r;
      return true;
    }
    case FERRY_RECIPE_FLOAT8_CURRENT_SCALING: {
      ferry::Float8CurrentScaling r;
      r.fp8_format = fmt;
      r.fp8_dpa = c.fp8_dpa != 0;
      r.fp8_mha = c.fp8_mha != 0;
      *out = r;
      return true;
    }
    case FERRY_RECIPE_MXFP8_BLOCK_SCALING: {
      ferry::MXFP8BlockScaling r;
      r.fp8_format = fmt;
      *out = r;
      return true;
    }
    case FERRY_RECIPE_FLOAT8_BLOCK_SCALING: {
      ferry::Float8BlockScaling r;
      r.fp8_format = fmt;
      r.x_block_scaling_dim = c.x_block_scaling_dim;
      r.w_block_scaling_dim = c.w_block_scaling_dim;
      r.grad_block_scaling_dim = c.grad_block_scaling_dim;
      *out = r;
      return true;
    }
    case FERRY_RECIPE_NVFP4_BLOCK_SCALING: {
      ferry::NVFP4BlockScaling r;
      r.disable_rht = c.disable_rht != 0;
      r.disable_stochastic_rounding = c.disable_stochastic_rounding != 0;
      r.disable_2d_quantization = c.disable_2d_quantization != 0;
      *out = r;
      return true;
    }
    case FERRY_RECIPE_CUSTOM: {
      ferry::CustomRecipe r;
      r.name = c.custom_name;
      if (c.custom_qfactory != nullptr) r.qfactory = c.custom_qfactory;
      *out = r;
      return true;
    }
    default:
      return false;
  }
}

// One direction of a scaling state, checked; `where` names the module and direction.
int ToDirection(const ferry_direction_state_t& c, const std::string& where,
                ferry::DirectionState* d, ferry_error_t* error) {
  if (c.direction != FERRY_DIRECTION_FORWARD && c.direction != FERRY_DIRECTION_BACKWARD) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(where, ": invalid direction ", c.direction));
  }
  if (c.num_slots < 0 || c.history_len < 0) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(where, ": negative num_slots or history_len"));
  }
  size_t slots = static_cast<size_t>(c.num_slots);
  size_t hist = slots * static_cast<size_t>(c.history_len);
  if ((slots > 0 && (c.slot_roles == nullptr || c.scale == nullptr)) ||
      (hist > 0 && c.amax_history == nullptr)) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(where, ": slot_roles, scale or amax_history is NULL"));
  }
  d->direction = static_cast<ferry::Direction>(c.direction);
  d->num_gemms = c.num_gemms;
  for (size_t k = 0; k < slots; ++k) {
    if (c.slot_roles[k] < FERRY_SLOT_INPUT || c.slot_roles[k] > FERRY_SLOT_GRAD_INPUT) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat(where, ": invalid slot role ", c.slot_roles[k], " in slot ", k));
    }
    d->slot_roles.push_back(static_cast<ferry::SlotRole>(c.slot_roles[k]));
  }
  if (slots > 0) d->scale.assign(c.scale, c.scale + slots);
  if (hist > 0) d->amax_history.assign(c.amax_history, c.amax_history + hist);
  d->history_len = c.history_len;
  return FERRY_OK;
}

// Fills `c` (already ferry_recipe_init-ed for the right kind) from a C++ recipe; custom names
// point into `owner`.
void FromRecipe(const ferry::Recipe& recipe, CScaling* owner) {
  ferry_recipe_t& c = owner->recipe;
  if (std::holds_alternative<ferry::DelayedScaling>(recipe)) {
    const auto& r = std::get<ferry::DelayedScaling>(recipe);
    ferry_recipe_init(&c, FERRY_RECIPE_DELAYED_SCALING);
    c.margin = r.margin;
    c.fp8_format = static_cast<int32_t>(r.fp8_format);
    c.amax_history_len = r.amax_history_len;
    c.amax_compute_algo = static_cast<int32_t>(r.amax_compute_algo);
    c.reduce_amax = r.reduce_amax;
    c.fp8_dpa = r.fp8_dpa;
    c.fp8_mha = r.fp8_mha;
  } else if (std::holds_alternative<ferry::Float8CurrentScaling>(recipe)) {
    const auto& r = std::get<ferry::Float8CurrentScaling>(recipe);
    ferry_recipe_init(&c, FERRY_RECIPE_FLOAT8_CURRENT_SCALING);
    c.fp8_format = static_cast<int32_t>(r.fp8_format);
    c.fp8_dpa = r.fp8_dpa;
    c.fp8_mha = r.fp8_mha;
  } else if (std::holds_alternative<ferry::MXFP8BlockScaling>(recipe)) {
    ferry_recipe_init(&c, FERRY_RECIPE_MXFP8_BLOCK_SCALING);
    c.fp8_format = static_cast<int32_t>(std::get<ferry::MXFP8BlockScaling>(recipe).fp8_format);
  } else if (std::holds_alternative<ferry::Float8BlockScaling>(recipe)) {
    const auto& r = std::get<ferry::Float8BlockScaling>(recipe);
    ferry_recipe_init(&c, FERRY_RECIPE_FLOAT8_BLOCK_SCALING);
    c.fp8_format = static_cast<int32_t>(r.fp8_format);
    c.x_block_scaling_dim = r.x_block_scaling_dim;
    c.w_block_scaling_dim = r.w_block_scaling_dim;
    c.grad_block_scaling_dim = r.grad_block_scaling_dim;
  } else if (std::holds_alternative<ferry::NVFP4BlockScaling>(recipe)) {
    const auto& r = std::get<ferry::NVFP4BlockScaling>(recipe);
    ferry_recipe_init(&c, FERRY_RECIPE_NVFP4_BLOCK_SCALING);
    c.disable_rht = r.disable_rht;
    c.disable_stochastic_rounding = r.disable_stochastic_rounding;
    c.disable_2d_quantization = r.disable_2d_quantization;
  } else if (std::holds_alternative<ferry::CustomRecipe>(recipe)) {
    const auto& r = std::get<ferry::CustomRecipe>(recipe);
    ferry_recipe_init(&c, FERRY_RECIPE_CUSTOM);
    owner->custom_name = r.name;
    owner->custom_qfactory = r.qfactory;
    c.custom_name = owner->custom_name.c_str();
    c.custom_qfactory = owner->custom_qfactory.empty() ? nullptr : owner->custom_qfactory.c_str();
  } else {
    ferry_recipe_init(&c, FERRY_RECIPE_NONE);
  }
}

}  // namespace

namespace ferry::capi {

int ToRecipe(const ferry_recipe_t& c, ferry::Recipe* out, const std::string& where,
             ferry_error_t* error) {
  auto bad = [&](const char* field, int32_t v) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(where, ": recipe field ", field, " has invalid value ", v));
  };
  if (c.fp8_format < 0 || c.fp8_format > FERRY_FP8_FORMAT_HYBRID) {
    if (c.kind != FERRY_RECIPE_NONE && c.kind != FERRY_RECIPE_NVFP4_BLOCK_SCALING &&
        c.kind != FERRY_RECIPE_CUSTOM) {
      return bad("fp8_format", c.fp8_format);
    }
  }
  if (c.kind == FERRY_RECIPE_DELAYED_SCALING && c.amax_compute_algo != FERRY_AMAX_COMPUTE_MAX &&
      c.amax_compute_algo != FERRY_AMAX_COMPUTE_MOST_RECENT) {
    return bad("amax_compute_algo", c.amax_compute_algo);
  }
  if (c.kind == FERRY_RECIPE_CUSTOM && (c.custom_name == nullptr || c.custom_name[0] == '\0')) {
    return Fail(error, FERRY_INVALID_ARGUMENT,
                ferry::StrCat(where, ": a custom recipe needs custom_name"));
  }
  return RecipeOf(c, out) ? FERRY_OK : bad("kind", c.kind);
}

int ToScalingState(const char* module, const ferry_recipe_t& recipe,
                   const ferry_direction_state_t* states, size_t num_states,
                   const std::string& path, ferry::ScalingState* out, ferry_error_t* error) {
  out->module = module;
  const std::string where = ferry::StrCat(path, ": scaling state ", ferry::Quote(module));
  int rc = ToRecipe(recipe, &out->recipe, where, error);
  for (size_t i = 0; rc == FERRY_OK && i < num_states; ++i) {
    ferry::DirectionState d;
    rc = ToDirection(states[i], ferry::StrCat(where, " direction ", i), &d, error);
    out->states.push_back(std::move(d));
  }
  return rc;
}

std::unique_ptr<CScaling> ToCScaling(const ferry::ScalingState& s) {
  auto c = std::make_unique<CScaling>();
  c->module = s.module;
  FromRecipe(s.recipe, c.get());
  c->dirs = s.states;
  c->roles.resize(c->dirs.size());
  c->cdirs.resize(c->dirs.size());
  for (size_t i = 0; i < c->dirs.size(); ++i) {
    const ferry::DirectionState& d = c->dirs[i];
    for (ferry::SlotRole r : d.slot_roles) c->roles[i].push_back(static_cast<int32_t>(r));
    ferry_direction_state_t& cd = c->cdirs[i];
    cd.direction = static_cast<int32_t>(d.direction);
    cd.num_gemms = d.num_gemms;
    cd.num_slots = static_cast<int32_t>(d.slot_roles.size());
    cd.history_len = d.history_len;
    cd.slot_roles = c->roles[i].empty() ? nullptr : c->roles[i].data();
    cd.scale = d.scale.empty() ? nullptr : d.scale.data();
    cd.amax_history = d.amax_history.empty() ? nullptr : d.amax_history.data();
  }
  return c;
}

void FillScaling(const CScaling& c, ferry_scaling_state_t* out) {
  ferry_scaling_state_t full;
  full.struct_size = sizeof(full);
  full.module = c.module.c_str();
  full.recipe = c.recipe;
  full.num_states = c.cdirs.size();
  full.states = c.cdirs.empty() ? nullptr : c.cdirs.data();
  FillSized(full, out);
}

}  // namespace ferry::capi

extern "C" {

void ferry_recipe_init(ferry_recipe_t* recipe, int32_t kind) {
  if (recipe == nullptr) return;
  std::memset(static_cast<void*>(recipe), 0, sizeof(*recipe));
  recipe->struct_size = sizeof(*recipe);
  recipe->kind = kind;
  ferry::DelayedScaling delayed;
  ferry::Float8BlockScaling block;
  recipe->margin = delayed.margin;
  recipe->amax_history_len = delayed.amax_history_len;
  recipe->amax_compute_algo = static_cast<int32_t>(delayed.amax_compute_algo);
  recipe->reduce_amax = delayed.reduce_amax;
  recipe->x_block_scaling_dim = block.x_block_scaling_dim;
  recipe->w_block_scaling_dim = block.w_block_scaling_dim;
  recipe->grad_block_scaling_dim = block.grad_block_scaling_dim;
  switch (kind) {
    case FERRY_RECIPE_DELAYED_SCALING:
    case FERRY_RECIPE_FLOAT8_CURRENT_SCALING:
      recipe->fp8_format = FERRY_FP8_FORMAT_HYBRID;
      break;
    default:
      recipe->fp8_format = FERRY_FP8_FORMAT_E4M3;
      break;
  }
}

}  // extern "C"
