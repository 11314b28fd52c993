"""colibrictl: the command-line client of colibrid.

It depends on msgpack and the Python standard library only, so it installs and runs on a
machine (or in a container) that has none of the daemon's dependencies.
"""

__version__ = "0.1.0"
