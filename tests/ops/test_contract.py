"""The backend contract (ops/contract.py) is kept by every backend: reference, cpu, metal, and the mix of metal and
reference stages that ops/stage_fallback.py routes to; a backend that drifts from it is refused, at import."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from splat_metal_method.ops import contract, cpu, metal, reference, stage_fallback


@pytest.fixture
def fallback_stages():
    stage_fallback.mark_failed({"sh", "rasterize"})
    yield stage_fallback.routed(metal)
    stage_fallback.reset()


@pytest.mark.parametrize("backend", [reference, cpu, metal], ids=["reference", "cpu", "metal"])
def test_every_backend_keeps_the_contract(backend):
    assert contract.mismatches(backend) == []
    for name in contract.STAGES:
        want = list(inspect.signature(getattr(contract.Backend, name)).parameters.values())[1:]
        have = list(inspect.signature(getattr(backend, name)).parameters.values())
        assert [(p.name, p.default) for p in have[: len(want)]] == [(p.name, p.default) for p in want], name


def test_the_stage_fallback_mix_keeps_the_contract(fallback_stages):
    assert contract.mismatches(fallback_stages) == []
    assert fallback_stages.spherical_harmonics is reference.spherical_harmonics
    assert fallback_stages.project is metal.project


def test_the_stage_fallback_owns_every_contract_stage():
    owned = [name for names in stage_fallback.STAGES.values() for name in names]
    assert sorted(owned) == sorted(contract.STAGES)


def test_the_contract_has_the_five_stages():
    assert contract.STAGES == ("project", "spherical_harmonics", "isect_tiles", "isect_offset_encode",
                               "rasterize_to_pixels", "rasterize_depth_chunk")  # fmt: skip


def _drifted(**stages):
    good = {name: getattr(reference, name) for name in contract.STAGES}
    return SimpleNamespace(**{**good, **stages})


def test_mismatches_finds_a_backend_that_drifts():
    def isect_tiles(means2d, radii, depths, tile_width, tile_size, tile_height):  # two names swapped
        pass

    def rasterize_to_pixels(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids,
                            backgrounds=None, absgrad=True):  # fmt: skip
        pass

    def spherical_harmonics(degree, dirs, coeffs, masks=None, activate=False, extra=None):  # a positional extra
        pass

    backend = _drifted(
        isect_tiles=isect_tiles, rasterize_to_pixels=rasterize_to_pixels, spherical_harmonics=spherical_harmonics
    )
    del backend.isect_offset_encode
    found = contract.mismatches(backend)
    assert len(found) == 4, found
    assert any(f.startswith("isect_tiles(means2d, radii, depths, tile_width") for f in found)
    assert any("rasterize_to_pixels's defaults" in f for f in found)
    assert any("extra parameter extra must be keyword-only" in f for f in found)
    assert "no isect_offset_encode" in found


def test_stage_refuses_a_drifted_implementation_and_gives_the_contract_defaults():
    def isect_offset_encode(isect_ids, C, tile_height, tile_width):
        pass

    with pytest.raises(TypeError, match=r"isect_offset_encode\(isect_ids, C, tile_height, tile_width\) is not"):
        contract.stage(isect_offset_encode)

    def spherical_harmonics(degree, dirs, coeffs, masks, activate):
        """Mine."""
        return masks, activate

    stage = contract.stage(spherical_harmonics)
    assert stage(0, None, None) == (None, False)  # the contract's defaults
    assert stage.__doc__.endswith("Mine.") and "SH bands" in stage.__doc__


def test_the_op_signature_is_the_call():
    from splat_metal_method.ops import distributed_rasterization, rasterization, rasterization_metal

    names = [f.name for f in contract.RasterizeCall.__dataclass_fields__.values()]
    assert list(inspect.signature(rasterization).parameters) == names
    assert list(inspect.signature(distributed_rasterization).parameters) == names + ["group", "absgrad_in_run"]
    metal_options = ["isect_capacity", "scales_are_log", "opacities_are_logits", "colors_rest",
                     "composite_background", "composite_squeeze", "tile_merge"]  # fmt: skip
    assert list(inspect.signature(rasterization_metal).parameters) == names + metal_options
    with pytest.raises(TypeError, match="unexpected keyword argument 'near'"):
        rasterization(*([None] * 9), near=0.1)
