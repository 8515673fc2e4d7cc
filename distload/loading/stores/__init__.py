"""Object stores: ``s3://``, ``gs://``, ``az://``; one module per store, SDKs imported inside.

``distload.loading.sources`` uses them to list a prefix and read headers; the ``ranged`` backend
to read tensors by byte range; the Run:ai backend to probe the endpoint before its reader runs
and to explain its ``File access error``. A new store is one module (an ObjectStore subclass)
and one line in ``STORES``.
"""

from __future__ import annotations

import os

from distload.loading.stores.azure import AzureStore
from distload.loading.stores.base import (
    READ_TIMEOUT_VARIABLE,
    Endpoint,
    Listing,
    ObjectStore,
    ObjectURI,
    parse_uri,
    probe_endpoint,
    read_timeout,
    scrub,
)
from distload.loading.stores.gcs import GCSStore
from distload.loading.stores.s3 import S3Store
from distload.runtime import RUNTIME

STORES: dict[str, type[ObjectStore]] = {cls.scheme: cls for cls in (S3Store, GCSStore, AzureStore)}


def get_store(scheme: str) -> ObjectStore:
    """The store for ``scheme`` configured from the current environment (one client per setting)."""
    cls = STORES[scheme]
    read_timeout()  # a malformed DISTLOAD_STORE_READ_TIMEOUT is a ConfigError before any request
    key = (scheme,) + tuple(os.environ.get(name) for name in cls.ENV_KEYS + (READ_TIMEOUT_VARIABLE,))
    with RUNTIME.lock:
        store = RUNTIME.stores.get(key)
        if store is None:
            store = RUNTIME.stores[key] = cls()
        return store


def store_for(uri: str) -> tuple[ObjectStore, ObjectURI]:
    location = parse_uri(uri)
    return get_store(location.scheme), location


__all__ = ["STORES", "Endpoint", "Listing", "ObjectStore", "ObjectURI", "get_store", "parse_uri",
           "probe_endpoint", "scrub", "store_for"]
