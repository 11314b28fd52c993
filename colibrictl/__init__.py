"""colibrictl: the command-line client of colibrid.

It depends on msgpack and the Python standard library only, so it installs and runs on a
machine (or in a container) that has none of the daemon's dependencies.
"""

from importlib import metadata

try:
    # pyproject.toml's `version`, as pip recorded it: the same source colibrid reads (this
    # package must not import colibrid, so each asks the installed metadata).
    __version__ = metadata.version("colibri")
except metadata.PackageNotFoundError:  # a source tree run without `pip install`
    __version__ = "0+unknown"
