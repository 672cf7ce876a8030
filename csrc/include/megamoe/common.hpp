// Shared host-side vocabulary: formats, recipes and the argument checks every op runs before it
// touches memory. Every check names the argument, what was expected and what was given.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <sstream>
#include <string>

#include "megamoe/formats.hpp"

namespace megamoe {

inline const char* to_string(WeightFormat f) {
  switch (f) {
    case WeightFormat::kFP8: return "fp8";
    case WeightFormat::kMXFP4: return "mxfp4";
    case WeightFormat::kNVFP4: return "nvfp4";
  }
  return "?";
}
inline const char* to_string(ActFormat f) { return f == ActFormat::kFP8 ? "fp8" : "fp4"; }

inline WeightFormat parse_weight_format(c10::string_view s, const char* arg = "weight_format") {
  if (s == "fp8") return WeightFormat::kFP8;
  if (s == "mxfp4") return WeightFormat::kMXFP4;
  if (s == "nvfp4") return WeightFormat::kNVFP4;
  TORCH_CHECK_VALUE(false, arg, ": expected one of 'fp8', 'mxfp4', 'nvfp4', got '", std::string(s), "'");
}

inline ActFormat parse_act_format(c10::string_view s, const char* arg = "act_format") {
  if (s == "fp8") return ActFormat::kFP8;
  if (s == "fp4") return ActFormat::kFP4;
  TORCH_CHECK_VALUE(false, arg, ": expected 'fp8' or 'fp4', got '", std::string(s), "'");
}

inline ActRecipe act_recipe(WeightFormat w, ActFormat a) {
  if (w == WeightFormat::kFP8) {
    TORCH_CHECK_VALUE(a == ActFormat::kFP8,
                      "act_format: FP8 block weights take 'fp8' activations, got '", to_string(a), "'");
    return ActRecipe::kFP8F32Block128;
  }
  if (a == ActFormat::kFP8) return ActRecipe::kFP8UE8M0Block32;
  return w == WeightFormat::kMXFP4 ? ActRecipe::kMXFP4 : ActRecipe::kNVFP4;
}

// Elements per scale along K for each recipe, and bytes of scale per token row of length K.
inline int64_t recipe_block(ActRecipe r) {
  switch (r) {
    case ActRecipe::kFP8F32Block128: return 128;
    case ActRecipe::kFP8UE8M0Block32: return 32;
    case ActRecipe::kMXFP4: return 32;
    case ActRecipe::kNVFP4: return 16;
  }
  return 0;
}
inline bool recipe_is_fp4(ActRecipe r) { return r == ActRecipe::kMXFP4 || r == ActRecipe::kNVFP4; }

// ---------------------------------------------------------------------------------------------
// Argument checks (run before any launch or write)
// ---------------------------------------------------------------------------------------------
template <typename... Args>
inline std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

inline std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

#define MEGAMOE_CHECK_DTYPE(t, name, dt)                                                        \
  TORCH_CHECK_TYPE((t).scalar_type() == (dt), name, ": expected dtype ", c10::toString(dt),  \
                   ", got ", c10::toString((t).scalar_type()))

#define MEGAMOE_CHECK_DIM(t, name, d) \
  TORCH_CHECK_VALUE((t).dim() == (d), name, ": expected ", d, " dimensions, got shape ", \
                    ::megamoe::shape_str((t).sizes()))

#define MEGAMOE_CHECK_SIZE(t, name, i, expected)                                                \
  TORCH_CHECK_VALUE((t).size(i) == (expected), name, ": expected size ", (expected), " at dim ", \
                    i, ", got shape ", ::megamoe::shape_str((t).sizes()))

#define MEGAMOE_CHECK_CONTIGUOUS(t, name) \
  TORCH_CHECK_VALUE((t).is_contiguous(), name, ": expected a contiguous tensor, got strides ", \
                    ::megamoe::shape_str((t).strides()))

#define MEGAMOE_CHECK_SAME_DEVICE(t, name, ref, ref_name)                                     \
  TORCH_CHECK_VALUE((t).device() == (ref).device(), name, ": expected device ",              \
                    (ref).device(), " (that of ", ref_name, "), got ", (t).device())

#define MEGAMOE_CHECK_MULTIPLE(v, name, m) \
  TORCH_CHECK_VALUE((v) % (m) == 0, name, ": expected a multiple of ", (m), ", got ", (v))

#define MEGAMOE_CHECK_POSITIVE(v, name) \
  TORCH_CHECK_VALUE((v) > 0, name, ": expected a positive value, got ", (v))

}  // namespace megamoe
