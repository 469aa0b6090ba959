"""After every kernel test: each library the dispatch code assembled for it is one that
variants.library_variants enumerates (so the compile checks and the macOS workflow, which build from that
enumeration, cannot miss a variant the host requests). A test that builds other libraries on purpose (planted
bugs, other windows) says so with @pytest.mark.planted_variants."""

from __future__ import annotations

import pytest

from splat_metal_method.ops.metal import kernels, variants


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "planted_variants: the test assembles libraries variants.library_variants does not enumerate"
    )


@pytest.fixture(autouse=True)
def requested_variants_are_enumerated(request):
    before = kernels.requested_variants()
    yield
    if request.node.get_closest_marker("planted_variants") is None:
        unlisted = variants.unlisted(kernels.requested_variants() - before)
        assert not unlisted, f"the dispatch requested libraries variants.library_variants does not yield: {unlisted}"
