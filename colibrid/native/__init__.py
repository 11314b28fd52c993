"""The bridge to libcolibri (being split into modules by concept; see compute.py for now)."""

from colibrid.native.compute import *  # noqa: F401,F403
from colibrid.native.compute import _lib, _PoolParams, ctypes  # noqa: F401  (tests reach these)
