"""Shared fixtures. The generators live in ``tests/scenes.py`` so any test module can import them
(``from scenes import random_scene``); this file only exposes them as fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import scenes` from any test directory

from scenes import GARDEN_PATH, SIZES, Scene, garden_scene, load_garden, random_scene  # noqa: E402,F401


@pytest.fixture
def make_scene():
    """Factory: ``make_scene(n=..., C=..., width=..., height=..., seed=..., dtype=..., ...)`` -> Scene."""
    return random_scene


@pytest.fixture(params=SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def size(request):
    """(width, height) pairs, square and non-square."""
    return request.param


@pytest.fixture(scope="session")
def garden():
    """The garden points and 3 real cameras (648x420) as numpy arrays; skips when the file is absent."""
    data = load_garden()
    if data is None:
        pytest.skip(f"garden data not found at {GARDEN_PATH} (it lives outside the repo, see docs/design.md section 5)")
    return data


def pytest_configure(config):
    """One grid seed for the whole run (tests/ops/test_backend_grid.py puts it in its test ids): 0 unless
    SPLAT_METAL_GRID_SEED asks for one, a number to replay a run or "random" to draw a new sample.
    pytest-xdist's workers inherit it from the controller and so collect the same tests."""
    import os
    import random

    seed = os.environ.get("SPLAT_METAL_GRID_SEED") or "0"
    if seed == "random":
        seed = str(random.SystemRandom().randrange(10**6))
    os.environ["SPLAT_METAL_GRID_SEED"] = seed


# The fast tier (`bash scripts/test.sh -m "not slow"`) leaves out SLOW_FILES and SLOW_TESTS; CI runs everything.
# Every kernel is still checked against the reference and every command (ns-train, ns-export, ns-eval, ns-render,
# ns-viewer, splat-metal-export, doctor, bench) still runs once (tests/test_tiers.py checks both).
# Files whose every test waits on several whole training runs that their module fixture starts (the time is in the
# fixture, so no one test of them is cheap): file -> what the fixture runs.
SLOW_FILES = {
    "tests/engine/test_distributed_cli.py": "two- and three-process torchrun trainings compared with one process",
    "tests/engine/test_reliability_cli.py": "five trainings (NaN recover/stop, determinism) and a Ctrl-C'd one",
    "tests/engine/test_resume_cli.py": "interrupted, resumed and uninterrupted trainings compared bit for bit",
    "tests/engine/test_checkpoint_failures.py": "a training against a full disk, then broken and stray checkpoints",
    "tests/engine/test_terminal_screen.py": "a whole training under a pseudo-terminal",
    "tests/method/test_mcmc_quality.py": "two real-capture trainings compared by held-out PSNR",
    "tests/data/test_documented_path.py": "ns-process-data on photos, then a training",
    "tests/viewer/test_distributed_viewer.py": "a two-process training serving the viewer",
    "tests/method/test_visible_adam_quality.py": "trainings with and without visible_adam compared by held-out PSNR",
    "tests/viewer/test_real_capture.py": "a training on the real phone capture, its held-out PSNR and viewer",
}
# Tests over ~5 s in a `--durations=0` run, and the extra points of grids whose first point stays fast. A
# parametrized test is listed by its full id.
SLOW_TESTS = {
    "tests/ops/metal/test_sh_adam.py::test_the_fused_sh_step_equals_its_unfused_twin_through_densification[1]",
    "tests/ops/metal/test_sh_adam.py::test_the_fused_sh_step_equals_its_unfused_twin_through_densification[2]",
    "tests/ops/metal/test_sh_adam.py::test_the_fused_sh_step_equals_its_unfused_twin_through_densification[3]",
    "tests/engine/test_memory.py::test_chunked_equals_unchunked_reference_forward_and_backward[7-reference]",
    "tests/data/test_bad_input.py::test_ns_train_rejects_bad_data_cleanly[duplicate-image]",
    "tests/data/test_bad_input.py::test_ns_train_rejects_bad_data_cleanly[scaled-rotation]",
    "tests/ops/metal/test_watchdog.py::test_a_padded_row_jump_stays_within_the_budget_on_the_emulator",
    "benchmarks/tests/test_step_ledger_budgets.py::test_counts_within_budgets",
    "tests/bench/test_bench_cli.py::test_vs_ab_trains_both_and_counts_fewer_atomics_with_the_other[tile-merge-direct-tile merge]",
    "tests/bench/test_mps_audit.py::test_audited_path_covers_the_training_step",
    "tests/bench/test_cuda_device_run.py::test_cpu_dry_run_of_the_commands_stage",
    "tests/bench/test_cuda_decode_exports.py::test_every_format_decodes_within_its_bounds",
    "tests/bench/test_mps_audit.py::test_steady_step_host_reads_within_budget",
    "tests/data/test_bad_input.py::test_ns_train_rejects_bad_data_cleanly[empty-folder]",
    "tests/data/test_bad_input.py::test_ns_train_rejects_bad_data_cleanly[missing-folder]",
    "tests/data/test_bad_input.py::test_ns_train_rejects_bad_data_cleanly[missing-image]",
    "tests/data/test_bad_input.py::test_ns_train_rejects_bad_data_cleanly[mixed-image-sizes]",
    "tests/data/test_bad_input.py::test_ns_train_rejects_bad_data_cleanly[no-transforms-json]",
    "tests/data/test_bad_input.py::test_ns_train_rejects_bad_data_cleanly[truncated-image]",
    "tests/data/test_bad_input.py::test_ns_train_rejects_bad_data_cleanly[zero-focal]",
    "tests/data/test_capture_checks.py::test_ns_train_stops_before_the_run_folder[downscale-folder-missing]",
    "tests/data/test_capture_checks.py::test_ns_train_stops_before_the_run_folder[one-frame]",
    "tests/data/test_capture_checks.py::test_ns_train_stops_before_the_run_folder[seed-points-nan]",
    "tests/data/test_demo_scene.py::test_generation_is_deterministic",
    "tests/data/test_demo_scene.py::test_nerfstudio_dataparser_loads_scene",
    "tests/data/test_distorted_scene.py::test_undistorting_a_lens_image_gives_back_the_pinhole_view[OPENCV]",
    "tests/data/test_image_stream.py::test_streamed_training_is_the_cached_training",
    "tests/data/test_images.py::test_datamanager_caches_16_bit_images_scaled[rgb]",
    "tests/data/test_images.py::test_training_on_a_16_bit_capture_matches_8_bit",
    "tests/engine/test_bad_options.py::test_ns_train_prints_the_line_and_writes_nothing",
    "tests/engine/test_distributed_shards.py::test_a_pause_longer_than_the_collective_timeout_is_waited_out_together",
    "tests/engine/test_distributed_shards.py::test_rows_parameters_moments_and_statistics_keep_their_global_order[3]",
    "tests/engine/test_memory.py::test_chunked_equals_unchunked_reference_forward_and_backward[7-metal]",
    "tests/engine/test_memory.py::test_max_gaussians_cap_holds_in_ns_train",
    "tests/export/test_export_formats.py::test_sh0_run_exports_rgb_as_dc",
    "tests/export/test_export_glb.py::test_babylon_draws_it",
    "tests/export/test_export_glb.py::test_decoded_renders_as_the_model",
    "tests/export/test_export_glb.py::test_interrupted_glb_writes_nothing",
    "tests/export/test_export_glb.py::test_playcanvas_engine_draws_it_as_the_ply",
    "tests/export/test_export_lod.py::test_a_sigkilled_lod_export_leaves_a_folder_the_next_export_removes",
    "tests/export/test_export_lod.py::test_supersplat_viewer_streams_the_coarsest_level_first",
    "tests/export/test_export_playcanvas.py::test_decoded_files_render_close_to_the_model",
    "tests/export/test_export_playcanvas.py::test_supersplat_viewer_renders_both_close_to_the_model",
    "tests/export/test_export_roundtrip.py::test_sh0_round_trip_reproduces_render",
    "tests/export/test_export_roundtrip.py::test_sh3_ply_layout_plyfile_and_open3d",
    "tests/export/test_palette.py::test_bounded_kmeans_no_worse_than_exact[34000-32768-None]",
    "tests/export/test_export_viewers_cesium.py::test_declared_as_it_is_cesium_takes_it_for_a_model_it_cannot_draw",
    "tests/export/test_export_viewers_cesium.py::test_control_the_same_gaussians_spz_compressed_are_drawn",
    "tests/export/test_export_viewers_spark.py::test_spark_renders_our_files_close_to_the_model",
    "tests/export/test_export_viewers_splat_transform3.py::test_decodes_sog_and_compressed_ply_as_our_readers[compressed]",
    "tests/export/test_export_viewers_splat_transform3.py::test_decodes_sog_and_compressed_ply_as_our_readers[sog]",
    "tests/export/test_export_viewers_splat_transform3.py::test_decodes_splat_as_antimatter15s_layout",
    "tests/export/test_export_viewers_splat_transform3.py::test_decodes_spz_to_our_values[3]",
    "tests/export/test_export_viewers_splat_transform3.py::test_decodes_spz_to_our_values[4]",
    "tests/export/test_export_viewers_splat_transform3.py::test_keeps_the_render_mode_in_the_ply_it_writes",
    "tests/export/test_export_viewers_splat_transform3.py::test_reads_every_lod_level_through_lod_meta_json",
    "tests/export/test_export_viewers_splat_transform3.py::test_reads_the_ply_exactly",
    "tests/export/test_export_viewers_splat_transform3.py::test_reads_the_render_mode[splat.compressed.ply-True]",
    "tests/export/test_export_viewers_splat_transform3.py::test_reads_the_render_mode[splat.lod/lod-meta.json-True]",
    "tests/export/test_export_viewers_splat_transform3.py::test_reads_the_render_mode[splat.ply-True]",
    "tests/export/test_export_viewers_splat_transform3.py::test_reads_the_render_mode[splat.sog-True]",
    "tests/export/test_export_viewers_splat_transform3.py::test_reads_the_render_mode[splat.splat-False]",
    "tests/export/test_export_viewers_splat_transform3.py::test_reads_the_render_mode[splat.spz-True]",
    "tests/export/test_export_viewers_splat_transform3.py::test_reads_the_render_mode[v4/splat.spz-True]",
    "tests/export/test_startup.py::test_quick_formats_import_nothing_heavy",
    "tests/method/test_cli_e2e.py::test_heldout_psnr_beats_baselines",
    "tests/method/test_cli_e2e.py::test_resume_continues_step_count",
    "tests/method/test_distorted_capture.py::test_nerfstudio_undistorts_to_smaller_sizes",
    "tests/method/test_distorted_capture.py::test_ns_eval_scores_undistorted_views_at_their_sizes",
    "tests/method/test_distorted_capture.py::test_ns_render_dataset",
    "tests/method/test_distorted_capture.py::test_resume_with_load_dir",
    "tests/method/test_distorted_capture.py::test_training_steps_render_the_undistorted_sizes[OPENCV_FISHEYE-False-cpu-True]",
    "tests/method/test_mcmc.py::test_trains_on_every_backend_relocating_and_growing_within_the_cap[metal]",
    "tests/method/test_mcmc_cli.py::test_continued_and_ctrl_c_resumed_runs_are_bit_identical_to_the_uninterrupted_one",
    "tests/method/test_mcmc_cli.py::test_export_gaussian_splat",
    "tests/method/test_mcmc_cli.py::test_short_run_scales_the_schedule_and_says_so",
    "tests/method/test_nerfstudio_tools.py::test_ns_render_interpolate_video",
    "tests/method/test_post_refine_stats.py::test_parameters_are_the_same_bits_and_statistics_stop_at_refine_stop[metal]",
    "tests/method/test_sh_degree_4.py::test_exports_keep_band_4_where_the_format_can",
    "tests/method/test_sh_degree_4.py::test_ns_train_trains_band_4_past_step_4_intervals",
    "tests/ops/metal/test_adam.py::test_fused_adam_matches_torch_adam_through_densification",
    "tests/ops/metal/test_backward_kernels.py::test_garden_cameras_gradients[cpu]",
    "tests/ops/metal/test_backward_kernels.py::test_standard_variants_include_the_backward_libraries",
    "tests/ops/metal/test_bins.py::test_a_tile_of_ten_thousand_is_sorted_exactly[52-90-16-(2, 3)]",
    "tests/ops/metal/test_emulator_asan.py::test_kernel_suite_passes_under_asan",
    "tests/ops/metal/test_emulator_tg_switch.py::test_kernel_suite_passes_under_the_switch_build",
    "tests/ops/metal/test_emulator_fp_contract.py::test_kernel_comparisons_hold_under_fp_contraction",
    "tests/ops/metal/test_emulator_fp_contract.py::test_garden_render_under_fp_contraction",
    "tests/ops/metal/test_emulator_ubsan.py::test_nonfinite_inputs_run_clean_under_ubsan",
    "tests/ops/metal/test_fused_adam.py::test_the_fused_step_equals_its_unfused_twins_through_densification[0]",
    "tests/ops/metal/test_fused_adam.py::test_the_fused_step_equals_its_unfused_twins_through_densification[1]",
    "tests/ops/metal/test_fused_adam.py::test_the_fused_step_equals_its_unfused_twins_through_densification[2]",
    "tests/ops/metal/test_fused_adam.py::test_the_fused_step_equals_its_unfused_twins_through_densification[3]",
    "tests/ops/metal/test_fused_adam.py::test_the_fused_step_matches_torch_adam",
    "tests/ops/metal/test_metal_training.py::test_fused_sh_step_training_run_matches_its_twin",
    "tests/ops/metal/test_variants.py::test_every_checked_library_passes_the_checks_at_every_msl_version",
    "tests/ops/metal/test_kernel_limits.py::test_every_kernel_of_every_variant_has_threadgroup_memory_to_spare",
    "tests/ops/metal/test_variants.py::test_every_standard_library_passes_the_checks_at_every_msl_version",
    "tests/ops/metal/test_metal_training.py::test_thirty_training_steps_metal_vs_reference",
    "tests/ops/metal/test_pipeline_limits.py::test_rasterizer_runs_in_tile_strips_where_the_pipeline_allows_fewer_threads[128-8]",
    "tests/ops/metal/test_sh_adam.py::test_the_fused_sh_step_matches_torch_adam",
    "tests/ops/metal/test_visible_adam.py::test_a_planted_bug_in_adam_steps_mask_fails_the_torch_comparison",
    "tests/ops/metal/test_visible_adam.py::test_a_planted_bug_in_the_kernels_skip_fails_the_twin_comparison",
    "tests/ops/metal/test_visible_adam.py::test_the_fused_step_equals_the_twin_through_densification[3]",
    "tests/ops/metal/test_visible_adam.py::test_the_metal_steps_match_torch_adam_with_the_culled_rows_kept",
    "tests/ops/test_cpu_backend.py::test_gcc_and_clang_builds_agree",
    "tests/ops/test_distributed.py::test_two_ranks_match_one_process",
    "tests/ops/test_nonfinite.py::test_nonfinite_input_has_one_meaning[means-nan-metal]",
    "tests/ops/test_reference.py::test_garden_images_are_sane",
    "tests/test_previous_layout.py::test_ns_eval_reads_an_old_run",
    "tests/test_previous_layout.py::test_ns_export_and_splat_metal_export_read_an_old_run",
    "tests/test_previous_layout.py::test_ns_train_resumes_an_old_run_with_load_dir",
    "tests/verify/test_doctor.py::test_all_variants_compile_with_apples_compiler_on_mps",
    "tests/verify/test_doctor.py::test_all_variants_linux_checks_pass",
    "tests/verify/test_self_check.py::test_ns_train_checks_metal_kernels_first_and_falls_back_on_a_wrong_one",
    "tests/viewer/test_opening_view.py::test_browser_opens_on_the_first_training_camera",
    "tests/viewer/test_opening_view.py::test_ns_viewer_opens_on_the_first_training_camera",
    "tests/viewer/test_opening_view.py::test_the_opening_cameras_frustum_is_hidden_and_the_others_drawn",
    "tests/viewer/test_viewer.py::test_browser_ns_viewer_on_a_finished_run_forced_metal",
    "tests/viewer/test_viewer.py::test_browser_shows_training_in_the_viewer",
}


# The fast tier's longest files, longest first (each over 20 s of its fast tests' total in a quiet 2-worker
# `pytest -m "not slow" --durations=0` run, 2026-12-07):
# pytest-xdist's loadfile hands files to the workers in collection order, so these go first and the short
# ones fill in after them, instead of a long file starting last and holding one worker after the other is done.
LONG_FILES = (
    "tests/ops/test_reference.py",
    "tests/method/test_cli_e2e.py",
    "tests/ops/test_cpu_backend.py",
    "tests/ops/metal/test_backward_kernels.py",
    "tests/ops/metal/test_emulator_checks.py",
    "tests/export/test_export_formats.py",
    "tests/ops/test_backend_grid.py",
    "tests/method/test_post_refine_stats.py",
    "tests/bench/test_mps_audit.py",
)


def pytest_collection_modifyitems(config, items):
    """Marks the tests of SLOW_FILES and SLOW_TESTS `slow` (one list here, so that test files need no marker
    edits) and collects LONG_FILES first (the order within a file stays)."""
    for item in items:
        if item.nodeid in SLOW_TESTS or item.nodeid.split("::")[0] in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
    first = {path: i for i, path in enumerate(LONG_FILES)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # a stable sort
