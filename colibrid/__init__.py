"""Colibri: run Mixture-of-Experts language models larger than RAM as a Linux service."""

__version__ = "0.1.0"
