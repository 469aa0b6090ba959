"""The MSL emulator and the runtime seam: every guarantee the Metal kernels' tests rely on."""

from pathlib import Path

import numpy as np
import pytest
import torch

from splat_metal_method.ops.metal import runtime
from splat_metal_method.ops.metal.emulator import EmulatorError, MetalCompileError, compile_library, library

KERNELS = Path(__file__).parent / "kernels"


@pytest.fixture(scope="module")
def lib():
    return compile_library(runtime.load_source(KERNELS / "emulator_tests.metal"), "emulator_tests")


@pytest.mark.parametrize(
    "shape, group",
    [((13, 1, 1), (4,)), ((13, 7, 1), (4, 4)), ((13, 7, 5), (4, 4, 2)), ((1000, 1, 1), (256,))],
)
def test_elementwise_matches_torch_with_partial_groups(lib, shape, group):
    nx, ny, nz = shape
    x = torch.randn(nz, ny, nx)
    out = torch.full_like(x, float("nan"))
    threads = shape[: len(group)]
    lib.axpb_3d(out, x, nx, ny, 2.5, -1.25, threads=threads, group_size=group)
    torch.testing.assert_close(out, 2.5 * x - 1.25, rtol=0, atol=1e-6)


def test_position_attributes_follow_metal_definitions(lib):
    W, H, gx, gy = 37, 22, 16, 4  # edge groups are 5 wide and 2 high
    out = torch.zeros(H, W, 17, dtype=torch.int32)
    lib.positions_2d(out, W, threads=(W, H), group_size=(gx, gy))
    o = out.numpy()
    y, x = np.mgrid[0:H, 0:W]
    tgx, tgy, tx, ty = x // gx, y // gy, x % gx, y % gy
    ax = np.minimum(gx, W - tgx * gx)  # actual width of this (possibly edge) group
    ay = np.minimum(gy, H - tgy * gy)
    tidx = tx + ty * ax
    expected = [
        x,
        y,
        tx,
        ty,
        tgx,
        tgy,
        ax,
        ay,
        np.full_like(x, W),
        np.full_like(x, H),
        tidx,
        tidx % 32,
        tidx // 32,
        np.full_like(x, 32),
        (ax * ay + 31) // 32,
        np.full_like(x, 32),
        np.ones_like(x),
    ]
    for k, e in enumerate(expected):
        np.testing.assert_array_equal(o[..., k], e, err_msg=f"attribute column {k}")


def test_threadgroup_reduction_with_barriers(lib):
    n = 1000  # 4 groups, the last one partial (masked, not returned)
    x = torch.randn(n)
    out = torch.zeros(4)
    lib.group_sum(out, x, n, threads=n, group_size=256)
    expected = torch.stack([c.sum() for c in x.split(256)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_threads_communicate_across_many_barrier_phases(lib):
    n, rounds = 768, 5
    x = torch.arange(n, dtype=torch.float32)
    out = torch.zeros(n)
    lib.rotate_rounds(out, x, rounds, threads=n, group_size=256)
    t = torch.arange(n)
    expected = (t // 256) * 256 + (t % 256 + rounds) % 256
    torch.testing.assert_close(out, expected.float())


def test_helpers_take_threadgroup_pointers(lib):
    n = 300  # groups of 128, 128 and 44
    x = torch.randint(-9, 10, (n,)).float()
    out = torch.zeros(n)
    lib.group_scan(out, x, threads=n, group_size=128)
    expected = torch.cat([c.cumsum(0) for c in x.split(128)])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_unsupported_threadgroup_use_is_refused():
    src = (
        "#include <metal_stdlib>\nusing namespace metal;\n"
        "kernel void two(device float* o [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {\n"
        "  threadgroup float a[4], b[4];\n  a[i] = 1.0f; b[i] = 2.0f; o[i] = a[i] + b[i];\n}\n"
    )
    with pytest.raises(EmulatorError, match=r"unsupported use of `threadgroup` at line 4"):
        compile_library(src, "two")


def test_a_race_shows_as_different_results_across_schedule_seeds(lib, monkeypatch):
    # racy_neighbour reads a neighbour's shared value without a barrier. Threads run in a seeded shuffled
    # order between barriers, so whether the neighbour already wrote depends on the seed: the result is
    # wrong (poison NaN) for some threads and differs from seed to seed, as it may on the GPU.
    n = 256
    x = torch.arange(n, dtype=torch.float32) + 1.0
    outs = []
    for seed in (0, 2, 4):
        monkeypatch.setenv("SPLAT_METAL_EMU_SEED", str(seed))
        out = torch.zeros(n)
        lib.racy_neighbour(out, x, threads=n, group_size=256)
        outs.append(out)
    correct = torch.roll(x, -1)
    for out in outs:
        assert torch.isnan(out).any() and (out == correct).any(), "some threads should win the race, some lose it"
    assert not torch.equal(torch.isnan(outs[0]), torch.isnan(outs[1])), "the seed should change who wins"
    # the same seed gives the same schedule
    again = torch.zeros(n)
    lib.racy_neighbour(again, x, threads=n, group_size=256)
    assert torch.equal(torch.isnan(again), torch.isnan(outs[-1]))


@pytest.mark.parametrize("seed, poison_f, poison_i", [(0, None, -1), (1, 3.3961514e38, 0x7F7F7F7F)])
def test_uninitialised_threadgroup_memory_is_poisoned_in_every_group(lib, monkeypatch, seed, poison_f, poison_i):
    # uninit_shared: thread 0 of each group reads a shared slot nobody wrote. Every group (not only the
    # first one an OS thread runs) must see the poison: NaN / -1 (even seeds), 3.4e38 / 0x7F7F7F7F (odd).
    monkeypatch.setenv("SPLAT_METAL_EMU_SEED", str(seed))
    monkeypatch.setenv("SPLAT_METAL_EMU_THREADS", "1")  # one OS thread runs all groups: reuse is certain
    n = 5 * 256
    out, out_i = torch.zeros(n), torch.zeros(n, dtype=torch.int32)
    lib.uninit_shared(out, out_i, threads=n, group_size=256)
    first, first_i = out.view(5, 256)[:, 0], out_i.view(5, 256)[:, 0]
    assert (torch.isnan(first) if poison_f is None else first == poison_f).all(), first
    assert (first_i == poison_i).all(), first_i
    t = torch.arange(1, 256)
    assert (out.view(5, 256)[:, 1:] == t.float()).all() and (out_i.view(5, 256)[:, 1:] == t.int()).all()


def test_max_total_threads_per_threadgroup_is_enforced_like_torch(lib):
    out = torch.zeros(128)
    lib.limited_64(out, threads=128, group_size=64)
    lib.limited_32(out, threads=128, group_size=32)
    assert out.tolist() == [2.0] * 128
    assert lib.limited_32.max_total_threads_per_threadgroup == 32
    with pytest.raises(
        EmulatorError, match=r"limited_64.*128 threads, more than .*max_total_threads_per_threadgroup\(64\)"
    ):
        lib.limited_64(out, threads=128, group_size=128)
    with pytest.raises(EmulatorError, match=r"limited_32.*64 threads"):
        lib.limited_32(out, threads=128, group_size=(64,))


def _simd_expected(x, flags, n, group):
    rows, ballots = np.zeros((n, 9), np.float32), np.zeros(n, np.int64)
    for g0 in range(0, n, group):
        gn = min(group, n - g0)
        for s0 in range(0, gn, 32):
            idx = np.arange(g0 + s0, g0 + min(s0 + 32, gn))
            v, f, m = x[idx], flags[idx] != 0, len(idx)
            lanes = np.arange(m)
            src = (lanes * 7 + 3) % 32
            down = lanes + 5
            rows[idx, 0] = v.sum()
            rows[idx, 1] = np.concatenate([[0], np.cumsum(v)[:-1]])
            rows[idx, 2] = np.cumsum(v)
            rows[idx, 3] = np.where(src < m, v[np.minimum(src, m - 1)], v)  # absent lane: own value
            rows[idx, 4] = np.where(down < m, v[np.minimum(down, m - 1)], v)
            rows[idx, 5] = v[2]
            rows[idx, 6], rows[idx, 7] = v.max(), v.min()
            rows[idx, 8] = float(f.any()) + 2.0 * float(f.all())
            ballots[idx] = int(sum(1 << int(lane) for lane in lanes[f]))
    return rows, ballots.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("n, group", [(200, 80), (64, 64), (96, 96)])
def test_simd_ops_match_numpy(lib, n, group):
    # integers keep the sums exact whatever the order; group 80 has a partial 16-lane simdgroup
    x = torch.randint(-50, 50, (n,)).float()
    flags = (torch.rand(n) < 0.5).int()
    flags[:32] = 1  # one simdgroup where simd_all is true
    out = torch.zeros(n, 9)
    ballot = torch.zeros(n, dtype=torch.int32)
    lib.simd_ops(out, ballot, x, flags, threads=n, group_size=group)
    rows, ballots = _simd_expected(x.numpy(), flags.numpy(), n, group)
    np.testing.assert_array_equal(out.numpy(), rows)
    np.testing.assert_array_equal(ballot.numpy(), ballots)


def test_atomics_from_many_groups_accumulate_exactly(lib):
    n, nbins = 100_003, 7
    x = torch.randint(0, 4, (n,)).float()  # integer-valued: exact in float32 in any order
    b = torch.randint(0, nbins, (n,), dtype=torch.int32)
    acc, cnt = torch.zeros(nbins), torch.zeros(nbins, dtype=torch.int32)
    lib.atomic_accumulate(acc, cnt, x, b, n, threads=n, group_size=128)
    torch.testing.assert_close(acc, torch.zeros(nbins).index_add_(0, b.long(), x), rtol=0, atol=0)
    torch.testing.assert_close(cnt, torch.bincount(b.long(), minlength=nbins).int())


def test_metal_layouts(lib):
    out = torch.zeros(8, dtype=torch.int64)
    lib.layout_sizes(out, threads=1, group_size=1)
    assert out.tolist() == [16, 16, 12, 48, 8, 16, 16, 16]


def test_float3_over_packed_tensor_is_wrong_like_on_a_mac(lib):
    n = 10
    p = torch.randn(n, 3)
    for name in ("read_xyz_floats", "read_xyz_packed"):
        out = torch.zeros(n, 3)
        getattr(lib, name)(out, p, threads=n, group_size=4)
        torch.testing.assert_close(out, p, rtol=0, atol=0)
    # reading `device float3*` strides 16 bytes; keep the read in bounds by padding the buffer
    padded = torch.cat([p.flatten(), torch.zeros(n)])
    out = torch.zeros(n, 3)
    lib.read_xyz_wrong(out, padded, threads=n, group_size=4)
    torch.testing.assert_close(out, padded[: 4 * n].view(n, 4)[:, :3], rtol=0, atol=0)
    assert not torch.equal(out, p)


def test_matrix_math_matches_numpy(lib):
    A = torch.tensor([[2.0, -1.0, 0.5], [0.0, 3.0, 1.0], [1.0, 0.25, -2.0]])
    v = torch.tensor([0.5, -1.5, 2.0])
    out = torch.zeros(32)
    lib.matrix_math(out, A.flatten().contiguous(), v, threads=1, group_size=1)
    a, x = A.double().numpy(), v.double().numpy()
    expected = np.concatenate(
        [
            a @ x,
            x @ a,
            (a @ a.T).T.flatten(),  # written column by column
            (np.eye(3)).flatten(),  # A + 2I*0.5 - A
            [4.0, 6.0],  # columns (1,2),(3,4) times (1,1)
            [np.linalg.det(a), np.linalg.norm(x), np.linalg.norm(x), np.cross(x, [0, 0, 1])[0]],
        ]
    )
    np.testing.assert_allclose(out.numpy()[: len(expected)], expected, rtol=1e-5, atol=1e-5)


def test_early_return_before_barrier_is_an_error(lib):
    with pytest.raises(EmulatorError, match=r"early_return.*returned while .* wait at a threadgroup_barrier"):
        lib.early_return(torch.zeros(300), 250, threads=300, group_size=128)
    lib.early_return(torch.zeros(256), 256, threads=256, group_size=128)  # no thread returns: fine


def test_divergent_barrier_is_an_error(lib):
    with pytest.raises(EmulatorError, match="divergent control flow"):
        lib.divergent_barrier(torch.zeros(64), threads=64, group_size=64)


def test_launch_checks(lib):
    x, out = torch.randn(16), torch.zeros(16)
    with pytest.raises(EmulatorError, match=r"axpb_3d.*expects 6 arguments"):
        lib.axpb_3d(out, x, 16, 1, 2.0, threads=16, group_size=16)
    with pytest.raises(EmulatorError, match=r"argument 2 \(nx: `constant long&`\) takes an int, got a tensor"):
        lib.axpb_3d(out, x, x, 1, 2.0, 1.0, threads=16, group_size=16)
    with pytest.raises(EmulatorError, match=r"argument 4 \(a: `constant float&`\) takes a float, got an int"):
        lib.axpb_3d(out, x, 16, 1, 2, 1.0, threads=16, group_size=16)
    with pytest.raises(EmulatorError, match=r"argument 2 \(nx.*takes an int, got a float"):
        lib.axpb_3d(out, x, 16.0, 1, 2.0, 1.0, threads=16, group_size=16)
    with pytest.raises(EmulatorError, match=r"argument 0 \(out.*takes a tensor, got a float"):
        lib.axpb_3d(1.0, x, 16, 1, 2.0, 1.0, threads=16, group_size=16)
    with pytest.raises(EmulatorError, match="contiguous"):
        lib.axpb_3d(out, torch.randn(16, 2)[:, 0], 16, 1, 2.0, 1.0, threads=16, group_size=16)
    with pytest.raises(EmulatorError, match=r"dtype torch.float64 does not match `float`"):
        lib.axpb_3d(out, x.double(), 16, 1, 2.0, 1.0, threads=16, group_size=16)
    with pytest.raises(EmulatorError, match="at most 1024"):
        lib.axpb_3d(out, x, 16, 1, 2.0, 1.0, threads=(16, 1), group_size=(64, 32))
    with pytest.raises(EmulatorError, match="same rank"):
        lib.axpb_3d(out, x, 16, 1, 2.0, 1.0, threads=(16, 1), group_size=16)
    with pytest.raises(EmulatorError, match="group_size="):
        lib.axpb_3d(out, x, 16, 1, 2.0, 1.0, threads=16)
    with pytest.raises(EmulatorError, match=r"too_much_shared.*40960 bytes of threadgroup memory"):
        lib.too_much_shared(out, threads=16, group_size=16)
    with pytest.raises(AttributeError, match="no kernel 'nope'"):
        lib.nope


def test_compile_error_names_metal_file_and_line():
    src = runtime.load_source(KERNELS / "bad_header.metal", KERNELS / "bad_kernel.metal")
    with pytest.raises(MetalCompileError, match=r"bad_kernel\.metal:6:.*undeclared_thing"):
        compile_library(src, "bad")


def test_swizzle_is_a_compile_error():
    with pytest.raises(MetalCompileError, match=r"swizzle\.metal:7:.*xy"):
        compile_library(runtime.load_source(KERNELS / "swizzle.metal"), "swizzle")


def test_cache_hit_skips_the_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLAT_METAL_CACHE_DIR", str(tmp_path))
    src = (
        "#include <metal_stdlib>\nusing namespace metal;\n"
        "kernel void fill(device float* o [[buffer(0)]], constant float& v [[buffer(1)]],"
        " uint i [[thread_position_in_grid]]) { o[i] = v; }\n"
    )
    before = library.compile_count()
    compile_library(src)
    assert library.compile_count() == before + 1
    assert len(list(tmp_path.glob("*.so"))) == 1
    library._loaded.clear()  # forget the in-process library, as a new process would
    lib2 = compile_library(src)
    assert library.compile_count() == before + 1
    out = torch.zeros(5)
    lib2.fill(out, 3.0, threads=5, group_size=2)
    assert out.tolist() == [3.0] * 5


def test_runtime_seam_picks_emulator_for_cpu_and_counts_launches():
    src = runtime.load_source(KERNELS / "emulator_tests.metal", defines={"UNUSED_SCALE": 0.5, "UNUSED_N": 3})
    assert src.startswith('#line 1 "<splat_metal defines>"\n#define UNUSED_SCALE 0.5f\n#define UNUSED_N 3\n')
    assert f'#line 1 "{KERNELS / "emulator_tests.metal"}"' in src
    lib = runtime.library_for(torch.device("cpu"), src)
    assert lib.runtime == "emulator"
    assert runtime.library_for("cpu", src) is lib  # compiled once per process
    runtime.reset_launch_counts()
    x, out = torch.randn(8), torch.zeros(8)
    for _ in range(3):
        lib.axpb_3d(out, x, 8, 1, 1.0, 0.0, threads=8, group_size=8)
    lib.layout_sizes(torch.zeros(8, dtype=torch.int64), threads=1, group_size=1)
    assert runtime.launch_counts() == {"axpb_3d": 3, "layout_sizes": 1}
    runtime.reset_launch_counts()
    assert runtime.launch_counts() == {}
    with pytest.raises(ValueError, match="not on cuda"):
        runtime.library_for("cuda", src)


PACKED_LISTS = (
    "#include <metal_stdlib>\nusing namespace metal;\n"
    "kernel void unpack(device float* out [[buffer(0)]], constant long* ints [[buffer(1)]],\n"
    "                   constant float* floats [[buffer(2)]], constant long& n [[buffer(3)]],\n"
    "                   uint i [[thread_position_in_grid]]) {\n"
    "  out[i] = i < uint(n) ? float(ints[i]) : floats[i - uint(n)];\n}\n"
    "kernel void as_int32(device float* out [[buffer(0)]], constant int* ints [[buffer(1)]],\n"
    "                     uint i [[thread_position_in_grid]]) { out[i] = float(ints[i]); }\n"
    "kernel void by_reference(device float* out [[buffer(0)]], constant long& v [[buffer(1)]],\n"
    "                         uint i [[thread_position_in_grid]]) { out[i] = float(v); }\n"
)


def test_a_list_binds_as_one_packed_array_like_compile_shader():
    """An int list packs int64 (bools as 0/1), a float list float32 (its ints converted), each one setBytes slot; what
    torch refuses (empty, a float after an int first, tensors) is refused, and so is a declaration that reads the
    bytes as another type (`constant int*` over int64) or a list bound by reference."""
    lib = compile_library(PACKED_LISTS, "packed_lists")
    out = torch.zeros(7)
    lib.unpack(out, [3, -(2**40), True], (0.1, 2, -7.5, 1e-8), 3, threads=7, group_size=7)
    want = torch.tensor([3.0, float(-(2**40)), 1.0, 0.1, 2.0, -7.5, 1e-8], dtype=torch.float32)
    assert torch.equal(out, want)
    with pytest.raises(EmulatorError, match=r"argument 1 \(ints.*an empty list"):
        lib.unpack(out, [], [1.0], 0, threads=7, group_size=7)
    with pytest.raises(EmulatorError, match=r"first element is an int packs every element as int64"):
        lib.unpack(out, [1, 2.5], [1.0], 0, threads=7, group_size=7)
    with pytest.raises(EmulatorError, match=r"argument 2 \(floats.*a list of ints binds as int64.*`constant long\*`"):
        lib.unpack(out, [1], [1, 2], 0, threads=7, group_size=7)
    with pytest.raises(EmulatorError, match=r"a list of tensors"):
        lib.unpack(out, [torch.zeros(1)], [1.0], 0, threads=7, group_size=7)
    with pytest.raises(EmulatorError, match=r"setBytes takes at most 4096"):
        lib.unpack(out, [1] * 513, [1.0], 0, threads=7, group_size=7)
    lib.unpack(out, [1] * 512, [1.0] * 1024, 0, threads=7, group_size=7)  # 4096 bytes each
    assert torch.equal(out, torch.ones(7))
    with pytest.raises(EmulatorError, match=r"argument 1 \(ints: `constant int\*`\).*declare `constant long\*`"):
        lib.as_int32(out, [1, 2], threads=2, group_size=2)
    with pytest.raises(EmulatorError, match=r"argument 1 \(v: `constant long&`\).*declare `constant long\*`"):
        lib.by_reference(out, [5], threads=2, group_size=2)
    with pytest.raises(EmulatorError, match=r"argument 0 \(out: `device float\*`\).*declare `constant float\*`"):
        lib.unpack([1.0] * 7, [1], [1.0], 0, threads=7, group_size=7)
