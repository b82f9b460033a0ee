"""Shared test setup: seqlib is imported first (it routes MLX's BLAS), hypothesis is deterministic."""

import os

import seqlib  # noqa: F401  (before mlx.core, as users are told to)
from hypothesis import settings

settings.register_profile("seqlib", derandomize=True, deadline=None, max_examples=40, print_blob=True)
settings.register_profile("thorough", derandomize=False, deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "seqlib"))
