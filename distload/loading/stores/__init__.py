"""Object stores: ``s3://``, ``gs://``, ``az://``; one module per store, SDKs imported inside.

``distload.loading.sources`` uses them to list a prefix and read headers; the ``ranged`` backend to read
tensors by byte range; the Run:ai backend to probe the endpoint before its reader runs and to
explain its ``File access error``.
"""

from distload.loading.stores.base import (
    ObjectStore,
    ObjectURI,
    Endpoint,
    Listing,
    get_store,
    parse_uri,
    probe_endpoint,
    scrub,
    store_for,
)

__all__ = ["Endpoint", "Listing", "ObjectStore", "ObjectURI", "get_store", "parse_uri", "probe_endpoint",
           "scrub", "store_for"]
