"""splat_metal_method/patches/startup.py: nerfstudio's external-method stand-ins are built without
``inspect.stack()`` (a third of every ns-* command's start-up), and a user who picks an external
method on the command line still gets nerfstudio's install offer."""

from __future__ import annotations

import inspect

import pytest
from nerfstudio.configs.external_methods import ExternalMethod, ExternalMethodDummyTrainerConfig, get_external_methods

import splat_metal_method.method.configs  # noqa: F401  (applies the fix, as ns-train's plugin discovery does)
from splat_metal_method.patches import startup as startup_fix


def _no_stack(*args, **kwargs):
    raise AssertionError("inspect.stack() was called")


def test_building_the_stand_ins_does_not_read_the_stack(monkeypatch):
    monkeypatch.setattr(inspect, "stack", _no_stack)
    configs, descriptions = get_external_methods()
    assert len(configs) >= 20 and configs.keys() == descriptions.keys()
    assert all(isinstance(c, ExternalMethodDummyTrainerConfig) for c in configs.values())


def test_picking_an_external_method_still_offers_to_install_it(capsys):
    method = ExternalMethod("To enable Elsewhere-NeRF, install it first", [("elsewhere", "a method")])
    with pytest.raises(SystemExit) as stopped:  # no pip package: the instructions, then exit 0
        ExternalMethodDummyTrainerConfig(method_name="elsewhere", method=method)
    assert stopped.value.code == 0
    assert "To enable Elsewhere-NeRF, install it first" in capsys.readouterr().out


def test_apply_is_idempotent():
    wrapped = ExternalMethodDummyTrainerConfig.__post_init__
    startup_fix.apply()
    assert ExternalMethodDummyTrainerConfig.__post_init__ is wrapped
