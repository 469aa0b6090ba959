"""Viewer glue: where ns-viewer and the training viewer render (device and backend)."""
