"""The real spherical-harmonics basis polynomials, the one source of them in Python (gsplat 1.4's
_eval_sh_bases_fast, Sloan 2013 evaluation order, as 3DGS; ops/metal/sh.h is the kernels' copy, expression
for expression), written over plain array arithmetic so that torch tensors (ops/reference.sh_bases) and
numpy arrays (export/gltf_file.sh_rotation, which runs without torch) both evaluate it.
"""

SH_C0 = 0.2820947917738781  # Y_0^0, the constant term
SH_C1 = 0.48860251190292


def sh_basis_terms(degree: int, x, y, z) -> list:
    """Terms 1 .. (degree+1)^2 - 1 of the basis (bands 1..degree, m = -l..l each; degree <= 4) at unit
    directions (x, y, z), each shaped as x; term 0 is the constant SH_C0, for the caller to make in its own
    array type (a full_like of x)."""
    out = []
    if degree >= 1:
        out += [-SH_C1 * y, SH_C1 * z, -SH_C1 * x]
    if degree >= 2:
        z2 = z * z
        fc1, fs1 = x * x - y * y, 2 * x * y
        tmp_b = -1.092548430592079 * z
        out += [
            0.5462742152960395 * fs1, tmp_b * y, 0.9461746957575601 * z2 - 0.3153915652525201,
            tmp_b * x, 0.5462742152960395 * fc1,
        ]  # fmt: skip
    if degree >= 3:
        tmp_c = -2.285228997322329 * z2 + 0.4570457994644658
        tmp_b = 1.445305721320277 * z
        fc2, fs2 = x * fc1 - y * fs1, x * fs1 + y * fc1
        out += [
            -0.5900435899266435 * fs2, tmp_b * fs1, tmp_c * y,
            z * (1.865881662950577 * z2 - 1.119528997770346),
            tmp_c * x, tmp_b * fc1, -0.5900435899266435 * fc2,
        ]  # fmt: skip
    if degree >= 4:
        tmp_d = z * (-4.683325804901025 * z2 + 2.007139630671868)
        tmp_c = 3.31161143515146 * z2 - 0.47308734787878
        tmp_b = -1.770130769779931 * z
        fc3, fs3 = x * fc2 - y * fs2, x * fs2 + y * fc2
        out += [
            0.6258357354491763 * fs3, tmp_b * fs2, tmp_c * fs1, tmp_d * y,
            1.984313483298443 * z2 * (1.865881662950577 * z2 - 1.119528997770346)
            - 1.006230589874905 * (0.9461746957575601 * z2 - 0.3153915652525201),
            tmp_d * x, tmp_c * fc1, tmp_b * fc2, 0.6258357354491763 * fc3,
        ]  # fmt: skip
    return out
