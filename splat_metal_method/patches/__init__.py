"""Fixes to upstream packages (nerfstudio 1.1.5, viser 0.2.7, torch's weights_only loads), each applied in one place."""
