"""The small demo scene the bad-input tests break (tests/data/conftest.py makes it once per module), and
the names of the run whose folder a refused ns-train must leave untouched."""

WIDTH, HEIGHT, VIEWS = 32, 24, 10  # non-square; the smallest demo scene with a held-out view: fast to make and copy
CLI_TIMEOUT = 180  # s; a failing start takes ~10-20 s (imports), a hang or a training run takes far longer
EXPERIMENT, TIMESTAMP = "existing", "2000-01-01_000000"
