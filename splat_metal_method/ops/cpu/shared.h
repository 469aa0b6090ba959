// shared.h: the math the native CPU backend shares with the Metal kernels (../metal/covar.h), for C++.
// covar.h calls sqrt, max and isfinite unqualified, as MSL does (metal::); in namespace splat_covar they are std's.
#pragma once

#include <algorithm>
#include <cmath>

namespace splat_covar {
using std::isfinite;
using std::max;
using std::sqrt;
#include "../metal/covar.h"
}  // namespace splat_covar
