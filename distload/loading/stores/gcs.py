"""Google Cloud Storage (and its emulators), with google-cloud-storage.

Credentials are resolved by Run:ai's own GCS package, as its reader does:
``RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS=1`` (public buckets, emulators),
``RUNAI_STREAMER_GCS_CREDENTIAL_FILE`` (a service-account JSON), else Application Default
Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, workload identity, gcloud). Another endpoint:
``STORAGE_EMULATOR_HOST`` (read by the Python client) or ``CLOUD_STORAGE_EMULATOR_ENDPOINT``
(read by Run:ai's C++ reader); set either, distload gives each side the other's value.

Run:ai's GCS reader retries a refused or wrong endpoint for minutes; distload checks the endpoint
answers (one TCP connect) before planning and again before handing the file list to the reader.
"""

from __future__ import annotations

import os

from distload.loading.stores.base import (
    CONNECT_TIMEOUT_S,
    RETRY_DEADLINE_S,
    Endpoint,
    Listing,
    ObjectStore,
    ObjectURI,
    first_line,
    read_timeout,
)

DEFAULT_GCS_ENDPOINT = "https://storage.googleapis.com"


def gcs_endpoint_setting(environ=os.environ) -> tuple[str | None, str]:
    for name in ("STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT"):
        if environ.get(name):
            value = environ[name]
            return (value if "://" in value else f"http://{value}"), name
    return None, ""


class GCSStore(ObjectStore):
    scheme = "gs"
    product = "GCS"
    bucket_word = "bucket"
    credential_hint = ("check GOOGLE_APPLICATION_CREDENTIALS or RUNAI_STREAMER_GCS_CREDENTIAL_FILE (a "
                       "service-account JSON) and the bucket's IAM; for a public bucket set "
                       "RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS=1")
    ENV_KEYS = ("STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT",
                "RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS", "RUNAI_STREAMER_GCS_CREDENTIAL_FILE",
                "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT")

    needs = ("Run:ai's GCS reader and google-cloud-storage", "gcs",
             ("google.cloud.storage", "runai_model_streamer_gcs.credentials.credentials"))

    def __init__(self) -> None:
        super().__init__()
        self._endpoint_url, self._endpoint_origin = gcs_endpoint_setting()

    def _retry(self):
        from google.cloud.storage.retry import DEFAULT_RETRY

        if hasattr(DEFAULT_RETRY, "with_timeout"):
            return DEFAULT_RETRY.with_timeout(RETRY_DEADLINE_S)
        return DEFAULT_RETRY.with_deadline(RETRY_DEADLINE_S)

    @property
    def _kw(self) -> dict:
        return {"timeout": (CONNECT_TIMEOUT_S, read_timeout()), "retry": self._retry()}

    def _make_client(self):
        import google.auth.exceptions
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage
        from runai_model_streamer_gcs.credentials.credentials import get_credentials

        try:
            credentials = get_credentials().gcp_credentials()
        except google.auth.exceptions.DefaultCredentialsError:
            if not self._endpoint_url:
                raise
            credentials = AnonymousCredentials()  # an emulator takes no credentials
        options = {"api_endpoint": self._endpoint_url} if self._endpoint_url else None
        return storage.Client(
            project=os.environ.get("GOOGLE_CLOUD_PROJECT") or "distload",
            credentials=credentials, client_options=options)

    def endpoint(self) -> Endpoint:
        if self._endpoint_url:
            return Endpoint(self._endpoint_url, self._endpoint_origin)
        return Endpoint(DEFAULT_GCS_ENDPOINT, "Google's default; no STORAGE_EMULATOR_HOST set")

    def reader_environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        if self._endpoint_url:
            for name in ("CLOUD_STORAGE_EMULATOR_ENDPOINT", "STORAGE_EMULATOR_HOST"):
                if not os.environ.get(name):
                    env[name] = self._endpoint_url
        return env

    def _list(self, location: ObjectURI, recursive: bool) -> Listing:
        listing = Listing()
        prefix = location.prefix
        blobs = self._client().list_blobs(location.bucket, prefix=prefix, delimiter=None if recursive else "/",
                                          **self._kw)
        for blob in blobs:
            name = blob.name[len(prefix):]
            if name and not name.endswith("/"):
                listing.objects[name] = int(blob.size or 0)
                if blob.generation is not None:
                    listing.versions[name] = str(blob.generation)
        listing.folders = sorted(p[len(prefix):] for p in blobs.prefixes)
        return listing

    def _read(self, location: ObjectURI, start: int, end: int) -> bytes:
        blob = self._client().bucket(location.bucket).blob(location.key)
        return blob.download_as_bytes(start=start, end=end - 1, checksum=None, **self._kw)

    def _read_version(self, location: ObjectURI, start: int, end: int, version: str) -> tuple[bytes, str | None]:
        from google.api_core.exceptions import PreconditionFailed

        blob = self._client().bucket(location.bucket).blob(location.key)
        try:
            data = blob.download_as_bytes(start=start, end=end - 1, checksum=None,
                                          if_generation_match=int(version), **self._kw)
        except PreconditionFailed:
            return b"", self._stat(location)[1]
        # The client takes the generation from the answer's x-goog-generation where it is sent
        # (GCS does; the emulator does not: then None, and read_version asks after the read).
        return data, None if blob.generation is None else str(blob.generation)

    def _stat(self, location: ObjectURI) -> tuple[int, str | None]:
        from google.api_core.exceptions import NotFound

        blob = self._client().bucket(location.bucket).get_blob(location.key, **self._kw)
        if blob is None:
            raise NotFound(f"no object {location.key!r} in bucket {location.bucket!r}")
        return int(blob.size or 0), None if blob.generation is None else str(blob.generation)

    def _bucket_exists(self, bucket: str) -> bool:
        return bool(self._client().bucket(bucket).exists(**self._kw))

    def classify(self, exc: BaseException) -> tuple[str, str] | None:
        import google.auth.exceptions as gae
        import requests
        from google.api_core import exceptions as gce

        if isinstance(exc, gce.RetryError) and exc.cause is not None:
            found = self.classify(exc.cause)
            if found:
                return found[0], f"{found[1]} (retried for {RETRY_DEADLINE_S:.0f} s)"
        if isinstance(exc, gae.DefaultCredentialsError):
            return "no-credentials", first_line(str(exc))
        if isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                            gae.TransportError)):
            return "unreachable", f"{type(exc).__name__}: {first_line(str(exc))}"
        if isinstance(exc, gae.RefreshError):
            return "access-denied", f"the credentials could not be refreshed: {first_line(str(exc))}"
        if isinstance(exc, gce.NotFound):
            return "bucket-missing-or-object", first_line(exc.message or str(exc))
        if isinstance(exc, (gce.Forbidden, gce.Unauthorized)):
            return "access-denied", f"HTTP {exc.code}: {first_line(exc.message or str(exc))}"
        if isinstance(exc, gce.GoogleAPICallError):
            return "other", f"HTTP {exc.code}: {first_line(exc.message or str(exc))}"
        return None
