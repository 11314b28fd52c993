"""The bridge to libcolibri (being split into modules by concept; see kernels.py for now)."""

from colibrid.native.kernels import *  # noqa: F401,F403
from colibrid.native.kernels import _lib, _PoolParams, ctypes  # noqa: F401  (tests reach these)
