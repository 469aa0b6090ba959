"""Verification: each kernel against the reference (kernel_checks), the self-check before a run, the doctor command."""
