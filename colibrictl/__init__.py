"""colibrictl: the command-line client of colibrid.

It speaks the protocol through colibrid.wire, which depends on msgpack and the Python standard
library only, and imports nothing else of colibrid: it runs on a machine (or in a container)
that has none of the daemon's dependencies.
"""

from importlib import metadata

try:
    # pyproject.toml's `version`, as pip recorded it: the same source colibrid reads, so the
    # two cannot disagree.
    __version__ = metadata.version("colibri")
except metadata.PackageNotFoundError:  # a source tree run without `pip install`
    __version__ = "0+unknown"
