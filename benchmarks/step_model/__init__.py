"""The step model and its instruments, outside the package (no user runs them): the extended step ledger
(ledger.py), the scale ledger's count-only counts (scale_ledger.py), the calibrated model of the peers (peers.py),
the step model (model.py), stored measurements (results.py: benchmarks/results/*.json) and the side-by-side run
with msplat (vs_msplat.py). README.md says what the model is and how far to trust it."""
