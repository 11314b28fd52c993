"""The Colibri pack: a converted model on disk (manifest, dense file, experts file,
tokenizer files). ``docs/format.md`` specifies it byte by byte."""

from colibrid.pack.manifest import FORMAT_VERSION, Manifest, PackError
from colibrid.pack.reader import Pack
from colibrid.pack.tensor import PackedTensor

__all__ = ["FORMAT_VERSION", "Manifest", "Pack", "PackError", "PackedTensor"]
