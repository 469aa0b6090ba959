// shared.h: the math the native CPU backend shares with the Metal kernels (../metal/covar.h, ../metal/sh.h),
// for C++. covar.h calls sqrt, max and isfinite unqualified, as MSL does (metal::); in namespace splat_covar
// they are std's. sh.h is plain float arithmetic.
#pragma once

#include <algorithm>
#include <cmath>

namespace splat_covar {
using std::isfinite;
using std::max;
using std::sqrt;
#include "../metal/covar.h"
}  // namespace splat_covar

namespace splat_sh {
#include "../metal/sh.h"
}  // namespace splat_sh
