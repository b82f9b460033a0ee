"""Shared test setup: MLX's BLAS routed as the book routes it, hypothesis deterministic."""

import os

import seqlib
from hypothesis import settings

seqlib.route_mlx_blas()  # as every chapter's first cell does

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
