// The environment switches that turn a path off, for comparisons and tests: NF4_OPS_WGMMA (csrc/gemv.cu),
// NF4_OPS_PDL (launch_cache.h), NF4_OPS_AVX512 (cpu_vector.h). Each is read once per process by its user.
#pragma once

#include <cstdlib>
#include <cstring>

namespace nf4 {

// Whether the environment sets `name` to exactly "0".
inline bool environment_turns_off(const char* name) {
  const char* setting = std::getenv(name);
  return setting != nullptr && std::strcmp(setting, "0") == 0;
}

}  // namespace nf4
