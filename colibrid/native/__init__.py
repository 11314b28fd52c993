"""The bridge to libcolibri: the only package that loads it (and, but for the thermal watch's
NVMe ioctl structure, the only one that imports ctypes).

It loads the C library, declares every function's signature, turns non-zero status codes
into typed exceptions (``ColibriError`` and its subclasses), and offers numpy-friendly
wrappers that check dtypes, contiguity and shapes *before* calling C, so a bad argument
raises instead of crashing the process. Callers use it as one namespace
(``from colibrid import native; native.matmul(...)``); the modules follow the concepts:

  errors        the exception of each status code
  library       loading, signatures, ABI checks, the status check, kernel level selection
  tensor_type   element types (col_type)
  arguments     buffer and size checks shared by the bindings
  pool          the worker pool
  compute       quantize, convert, get_rows, matmul, MoE experts and routers, norms, rope,
                attention
  layer_steps   the fused layer steps (attention, latent attention, Gated DeltaNet)
  checksum      CRC-32C
  aepc          the AEPC: slab pool, loader, expert cache
  io_priority   a thread's I/O priority (ioprio)
  residency     how much of a buffer is in memory (mincore, from the C library)
"""

# Every public name of every module is re-exported (no __all__ lists to keep in step: a
# binding added to a module is native.<name> at once). The private names are those tests
# and benchmarks reach for.
from colibrid.native.errors import *  # noqa: F401,F403
from colibrid.native.library import *  # noqa: F401,F403
from colibrid.native.tensor_type import *  # noqa: F401,F403
from colibrid.native.pool import *  # noqa: F401,F403
from colibrid.native.compute import *  # noqa: F401,F403
from colibrid.native.layer_steps import *  # noqa: F401,F403
from colibrid.native.checksum import *  # noqa: F401,F403
from colibrid.native.aepc import *  # noqa: F401,F403
from colibrid.native.io_priority import *  # noqa: F401,F403
from colibrid.native.residency import *  # noqa: F401,F403
from colibrid.native.library import _lib  # noqa: F401
from colibrid.native.pool import _PoolParams  # noqa: F401
