"""The inference engine: ``load(path)`` returns an :class:`Engine` with ``generate``
and the lower-level ``forward``.

Names are imported lazily so that ``colibrid.engine.text.tokenizer`` and friends can be
used without loading libcolibri.
"""

from __future__ import annotations

__all__ = ["Engine", "Session", "load"]


def __getattr__(name: str):
    if name in __all__:
        from colibrid.engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
