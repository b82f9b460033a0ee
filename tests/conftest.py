"""Shared test setup: seqlib is imported first (it routes MLX's BLAS), hypothesis is deterministic."""

import os

import seqlib  # noqa: F401  (before mlx.core, as users are told to)
from hypothesis import settings

settings.register_profile("seqlib", derandomize=True, deadline=None, max_examples=40, print_blob=True)
settings.register_profile("thorough", derandomize=False, deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "seqlib"))


def pytest_sessionfinish(session, exitstatus):
    """Under SEQLIB_BACKEND=emulate (``make unit-emulate``) the torch-parity tests must really have run the
    kernels: a run that launched none (a dispatch that ignores the backend) fails."""
    if os.environ.get("SEQLIB_BACKEND") == "emulate" and exitstatus == 0 and session.testscollected:
        from seqlib import emulation

        if emulation.launch_count() == 0:
            session.exitstatus = 1
            print("\nSEQLIB_BACKEND=emulate, yet no kernel was launched through seqlib.emulation")
