"""Colibri: run Mixture-of-Experts language models larger than RAM as a Linux service."""

from importlib import metadata

try:
    # pyproject.toml's `version` is the one place the version is written. pip copies it into the
    # installed metadata, and colibrid, colibri-convert and colibrictl (which must not import
    # this package) all read it from there, so the three cannot disagree.
    __version__ = metadata.version("colibri")
except metadata.PackageNotFoundError:  # a source tree run without `pip install`
    __version__ = "0+unknown"
