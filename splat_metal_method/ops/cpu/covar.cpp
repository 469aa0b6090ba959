// Native quat_scale_to_covar_preci forward (gsplat 1.4's op; MCMCStrategy shapes its position noise by
// the covariance every step), one gaussian per iteration on n_threads threads. The math is
// ../metal/covar.h (through shared.h), the same source the Metal kernel (covar.metal) compiles.
//
// Layouts (contiguous float32): quats [N,4] wxyz (normalised here), scales [N,3]; covars and precis
// [N,9] row-major 3x3, or [N,6] upper triangles [xx,xy,xz,yy,yz,zz] with triu; either may be null
// when not asked for.

#include <cstdint>

#include "parallel.h"
#include "shared.h"

extern "C" {

int splat_quat_scale_to_covar_preci_fwd(int64_t N, int triu, const float* quats, const float* scales,
                                        float* covars, float* precis, int n_threads) {
    using namespace splat_covar;
    const int width = triu != 0 ? 6 : 9;
    splat::parallel_for(N, n_threads, [&](int64_t i) {
        const float* q = quats + 4 * i;
        const SplatMat3 R = splat_quat_to_rotmat(q[0], q[1], q[2], q[3]);
        const float sx = scales[3 * i + 0], sy = scales[3 * i + 1], sz = scales[3 * i + 2];
        if (covars != nullptr) {
            const SplatMat3 cov = splat_covariance(R, sx, sy, sz);
            for (int k = 0; k < width; ++k) covars[width * i + k] = cov.m[triu != 0 ? splat_triu_index(k) : k];
        }
        if (precis != nullptr) {
            const SplatMat3 pre = splat_precision(R, sx, sy, sz);
            for (int k = 0; k < width; ++k) precis[width * i + k] = pre.m[triu != 0 ? splat_triu_index(k) : k];
        }
    }, 4096);
    return 0;
}

}  // extern "C"
