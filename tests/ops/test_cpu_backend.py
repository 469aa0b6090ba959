"""The native CPU backend ("cpu") against the reference, forward and backward, through the public op.

Every comparison runs both backends on the same inputs and compares the rendered colours and
alphas, every input gradient (means, quats, scales, opacities, colours/SH, viewmats, Ks, backgrounds),
means2d.grad and absgrad. Also: bit-identical results for any thread count, the fallback to the
reference with one warning when no compiler exists, and a scene dense enough that pixels hit the
transmittance floor (the stop rule) and alpha clamp.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from scenes import SIZES, garden_scene, load_garden, random_scene

from splat_metal_method.ops import BackendUnavailable, rasterization, resolve_backend
from splat_metal_method.ops.cpu import available

pytestmark = pytest.mark.skipif(not available(), reason="no C++ compiler here to build the native CPU backend")

GRAD_KEYS = ("means", "quats", "scales", "opacities", "colors", "viewmats", "Ks", "backgrounds")


def run(scene, backend, threads=None, **kw):
    """Forward + backward of a random weighted loss; returns {name: tensor} of outputs and grads."""
    inputs = {k: v.clone().requires_grad_(True) for k, v in scene.tensors().items() if k in GRAD_KEYS}
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        colors, alphas, meta = rasterization(**scene.kwargs(**inputs, backend=backend, absgrad=True, **kw))
        meta["means2d"].retain_grad()
        g = torch.Generator().manual_seed(3)
        weights = torch.randn(colors.shape, generator=g), torch.rand(alphas.shape, generator=g)
        loss = (colors * weights[0]).sum() + (alphas * weights[1]).sum()
        loss.backward()
    finally:
        torch.set_num_threads(previous)
    assert meta["backend"] == backend
    out = {"colors": colors.detach(), "alphas": alphas.detach(), "means2d.grad": meta["means2d"].grad,
           "absgrad": meta["means2d"].absgrad}  # fmt: skip
    out.update({f"{k}.grad": v.grad for k, v in inputs.items()})
    return out


def assert_matches_reference(scene, rtol=2e-4, **kw):
    want, got = run(scene, "reference", **kw), run(scene, "cpu", **kw)
    assert want.keys() == got.keys()
    for k in want:
        if want[k] is None:  # an input the render mode does not use (colours in "D")
            assert got[k] is None, f"{k}: the reference has no gradient here, cpu has one"
            continue
        assert got[k] is not None and torch.isfinite(got[k]).all(), f"{k}: missing or non-finite"
        scale = float(want[k].abs().max()) if want[k].numel() else 0.0
        err = float((got[k] - want[k]).abs().max()) if want[k].numel() else 0.0
        # Relative to the largest entry: reordered float32 sums of per-pixel terms, nothing more.
        assert err <= rtol * scale + 1e-6, f"{k}: max |cpu - reference| = {err:.3g} (largest entry {scale:.3g})"
    return want, got


@pytest.mark.parametrize("width,height", SIZES)
def test_matches_reference_on_random_scenes(width, height):
    scene = random_scene(n=300, C=2, width=width, height=height, seed=width, backgrounds=True)
    want, _ = assert_matches_reference(scene)
    assert want["alphas"].max() > 0.5  # the scene covers the image: the comparison is not vacuous


@pytest.mark.parametrize("render_mode", ["RGB", "D", "RGB+ED"])
@pytest.mark.parametrize("rasterize_mode", ["classic", "antialiased"])
def test_matches_reference_per_mode_with_sh(render_mode, rasterize_mode):
    scene = random_scene(n=200, C=2, width=45, height=29, seed=7, sh_degree=3, backgrounds=render_mode != "D")
    assert_matches_reference(scene, render_mode=render_mode, rasterize_mode=rasterize_mode)


@pytest.mark.parametrize("sh_degree", [0, 1, 2, 4])  # 3: above, in every mode
def test_matches_reference_at_every_sh_degree(sh_degree):
    scene = random_scene(n=200, C=2, width=45, height=29, seed=17, sh_degree=sh_degree, backgrounds=True)
    want, _ = assert_matches_reference(scene, render_mode="RGB+ED")
    assert want["colors.grad"][:, (sh_degree + 1) ** 2 - 1].abs().max() > 0  # the highest band is trained


def test_matches_reference_with_small_tiles_and_many_channels():
    scene = random_scene(n=150, C=1, width=33, height=19, seed=2, channels=11)
    assert_matches_reference(scene, tile_size=4)


def test_stop_rule_and_alpha_clamp_match_reference():
    # Many large, nearly opaque gaussians: most pixels reach the transmittance floor and many
    # alphas are clamped at 0.999, the two branches where backends most easily disagree.
    scene = random_scene(n=400, C=1, width=40, height=26, seed=9, opacity_range=(0.9, 1.0), scale_range=(0.2, 0.6))
    scene.opacities[:50] = 1.0
    want, _ = assert_matches_reference(scene)
    assert (want["alphas"] > 1 - 1e-3).float().mean() > 0.5, "the scene should saturate most pixels"


def test_matches_reference_on_garden():
    garden = load_garden()
    if garden is None:
        pytest.skip("../shared/data/garden_points.npz not found")
    # Real points and cameras (non-square 648x420), downscaled to keep the reference quick.
    scene = garden_scene(garden, n=20_000, seed=1)
    scene.Ks[:, :2] /= 4
    scene.width, scene.height = scene.width // 4, scene.height // 4
    scene.viewmats, scene.Ks = scene.viewmats[:2], scene.Ks[:2]
    want, _ = assert_matches_reference(scene)
    assert want["alphas"].mean() > 0.3


def test_empty_render_gives_zero_gradients():
    scene = random_scene(n=20, C=1, width=24, height=17, seed=1)
    scene.means += 100.0  # everything behind / outside the camera
    want, got = assert_matches_reference(scene)
    assert got["alphas"].abs().max() == 0 and got["means.grad"].abs().max() == 0


def test_rasterizer_is_bit_identical_for_any_thread_count():
    # The native stage alone: PyTorch's own ops (projection's einsum, ...) may round differently
    # with another intra-op thread count, on the reference backend too.
    from splat_metal_method.ops import cpu

    scene = random_scene(n=600, C=2, width=61, height=37, seed=5, scale_range=(0.05, 0.5))
    radii, means2d, depths, conics, _ = cpu.project(scene.means, scene.quats, scene.scales, scene.viewmats, scene.Ks,
                                                    scene.width, scene.height)  # fmt: skip
    tw, th = -(-scene.width // 16), -(-scene.height // 16)
    _, isect_ids, flatten_ids = cpu.isect_tiles(means2d, radii, depths, 16, tw, th)
    offsets = cpu.isect_offset_encode(isect_ids, scene.C, tw, th)
    colors = scene.colors.expand(scene.C, -1, -1).contiguous()
    opacities = scene.opacities.expand(scene.C, -1).contiguous()

    def rasterize(threads):
        leaves = [t.detach().clone().requires_grad_(True) for t in (means2d, conics, colors, opacities)]
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            image, alpha = cpu.rasterize_to_pixels(*leaves, scene.width, scene.height, 16, offsets, flatten_ids,
                                                   absgrad=True)  # fmt: skip
            (image * torch.linspace(-1, 1, image.numel()).reshape(image.shape)).sum().add(alpha.sum()).backward()
        finally:
            torch.set_num_threads(previous)
        return [image, alpha, leaves[0].absgrad] + [t.grad for t in leaves]

    runs = [rasterize(t) for t in (1, 2, 4, 1)]
    assert (runs[0][1] > 0.5).any()
    for other in runs[1:]:
        for i, (a, b) in enumerate(zip(runs[0], other)):
            assert torch.equal(a, b), f"output {i} differs between thread counts / runs"


def test_whole_op_is_bit_identical_run_to_run():
    scene = random_scene(n=300, C=2, width=45, height=31, seed=6, backgrounds=True)
    a, b = run(scene, "cpu"), run(scene, "cpu")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_float64_inputs_are_rasterized_by_the_reference():
    scene = random_scene(n=50, C=1, width=20, height=14, seed=4, dtype=torch.float64)
    want, got = run(scene, "reference"), run(scene, "cpu")
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_cpu_backend_refuses_other_devices():
    with pytest.raises(BackendUnavailable, match="CPU tensors"):
        resolve_backend("cpu", torch.device("meta"))


def test_without_compiler_auto_falls_back_to_reference_with_one_warning(tmp_path):
    script = textwrap.dedent(
        """
        import warnings, torch
        from scenes import random_scene
        from splat_metal_method.ops import BackendUnavailable, rasterization
        scene = random_scene(n=30, C=1, width=20, height=14)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backends = [rasterization(**scene.kwargs())[2]["backend"] for _ in range(3)]
        ours = [w for w in caught if "fast CPU backend" in str(w.message)]
        print("BACKENDS", backends)
        print("WARNINGS", len(ours))
        print("MESSAGE", ours[0].message if ours else "")
        try:
            rasterization(**scene.kwargs(backend="cpu"))
        except BackendUnavailable as err:
            print("EXPLICIT", err)
        """
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), SPLAT_METAL_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("SPLAT_METAL_BACKEND", None)
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = tests_dir + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "BACKENDS ['reference', 'reference', 'reference']" in res.stdout, res.stdout
    assert "WARNINGS 1" in res.stdout, res.stdout
    assert "no C++ compiler found" in res.stdout and "apt-get install g++" in res.stdout, res.stdout
    assert "EXPLICIT backend 'cpu' needs its native library" in res.stdout, res.stdout


@pytest.mark.parametrize("tile_size", [16, 4])
def test_isect_tiles_equals_reference_exactly(tile_size):
    from splat_metal_method.ops import cpu, reference

    scenes = [random_scene(n=500, C=3, width=w, height=h, seed=w) for w, h in SIZES]
    garden = load_garden()
    if garden is not None:
        scenes.append(garden_scene(garden, n=30_000, seed=2))  # the 3 real cameras, 648x420
    for scene in scenes:
        radii, means2d, depths, _, _ = reference.project(scene.means, scene.quats, scene.scales, scene.viewmats,
                                                         scene.Ks, scene.width, scene.height)  # fmt: skip
        tw, th = -(-scene.width // tile_size), -(-scene.height // tile_size)
        want = reference.isect_tiles(means2d, radii, depths, tile_size, tw, th)
        got = cpu.isect_tiles(means2d, radii, depths, tile_size, tw, th)
        assert want[1].numel() > 0
        for name, a, b in zip(("tiles_per_gauss", "isect_ids", "flatten_ids"), want, got):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs ({scene.width}x{scene.height})"


def test_builds_without_march_native_when_the_compiler_rejects_it(tmp_path):
    # Some compilers (older Apple clang on arm64) reject -march=native: the build retries without.
    real = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    wrapper = tmp_path / "picky-c++"
    calls = tmp_path / "calls.txt"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> "{calls}"\n'
        'case " $* " in *" -march=native "*) echo "error: unsupported option -march=native" >&2; exit 1;; esac\n'
        f'exec "{real}" "$@"\n'
    )
    wrapper.chmod(0o755)
    script = "from splat_metal_method.ops.cpu import build; print('LOADED', build.load() is not None, build.describe())"
    env = dict(os.environ, CXX=str(wrapper), SPLAT_METAL_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "LOADED True" in res.stdout, res.stdout + res.stderr
    assert "portable (no -march=native)" in res.stdout, res.stdout
    builds = [line for line in calls.read_text().splitlines() if "-shared" in line]
    assert len(builds) == 2 and "-march=native" in builds[0] and "-march=native" not in builds[1], builds


def test_gcc_and_clang_builds_agree(tmp_path):
    """macOS builds with Apple clang, Linux usually with g++: both builds of the native backend run
    the same scene (forward and backward) and must agree with each other."""
    compilers = [c for c in ("g++", "clang++") if shutil.which(c)]
    if len(compilers) < 2:
        pytest.skip(f"needs both g++ and clang++ (found {compilers}; scripts/test.sh installs clang on Debian)")
    script = textwrap.dedent(
        """
        import sys, torch
        from scenes import random_scene
        from splat_metal_method.ops import rasterization
        from splat_metal_method.ops.cpu import build
        assert build.load() is not None, build.unavailable_reason()
        scene = random_scene(n=400, C=2, width=45, height=29, seed=8, sh_degree=3, backgrounds=True)
        leaves = {k: v.clone().requires_grad_(True) for k, v in scene.tensors().items()}
        colors, alphas, meta = rasterization(**scene.kwargs(**leaves, backend="cpu", absgrad=True))
        (colors * torch.linspace(-1, 1, colors.numel()).view(colors.shape)).sum().add(alphas.sum()).backward()
        out = {"colors": colors.detach(), "alphas": alphas.detach()}
        out.update({k: v.grad for k, v in leaves.items()})
        torch.save(out, sys.argv[1])
        """
    )
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = {}
    for cxx in compilers:
        env = dict(os.environ, CXX=cxx, SPLAT_METAL_CACHE_DIR=str(tmp_path / cxx))
        env["PYTHONPATH"] = tests_dir + os.pathsep + env.get("PYTHONPATH", "")
        out = tmp_path / f"{cxx}.pt"
        res = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, env=env,
                             timeout=300)  # fmt: skip
        assert res.returncode == 0, f"{cxx}: {res.stderr[-3000:]}"
        assert list((tmp_path / cxx / "native").glob("*.so")), f"{cxx} built nothing"
        results[cxx] = torch.load(out)
    first, second = (results[c] for c in compilers)
    for k in first:
        scale = float(first[k].abs().max())
        err = float((first[k] - second[k]).abs().max())
        assert err <= 1e-6 * scale + 1e-7, f"{k}: g++ and clang++ builds differ by {err:.3g} (largest {scale:.3g})"
