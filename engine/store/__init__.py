"""Expert store (DESIGN §3): ``convert`` writes it, :class:`ExpertStore` reads it.

See :mod:`engine.store.manifest` for the directory layout and the manifest's invariants,
:mod:`engine.store.outdir` for what convert may touch, :mod:`engine.store.verify` for
``moestream verify``.
"""

from engine.store.manifest import ExpertEntry, StoreManifest, load_manifest
from engine.store.reader import ExpertStore, StoreDenseSource
from engine.store.verify import VerifyReport, verify_store
from engine.store.writer import ConvertSummary, convert

__all__ = ["ConvertSummary", "ExpertEntry", "ExpertStore", "StoreDenseSource", "StoreManifest",
           "VerifyReport", "convert", "load_manifest", "verify_store"]
