"""Azure Blob Storage (and Azurite), with azure-storage-blob.

Credentials in Run:ai's order: ``AZURE_STORAGE_CONNECTION_STRING``; else
``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_SAS_TOKEN`` or ``AZURE_STORAGE_ACCOUNT_KEY``;
else ``AZURE_STORAGE_ACCOUNT_NAME`` with DefaultAzureCredential (managed identity, ``az login``,
``AZURE_CLIENT_ID``/``AZURE_TENANT_ID``/``AZURE_CLIENT_SECRET``, ...).

Run:ai's C++ reader ignores connection strings: it always connects over HTTPS to
``https://$AZURE_STORAGE_ACCOUNT_NAME.$AZURE_STORAGE_ENDPOINT_SUFFIX`` (suffix default
``blob.core.windows.net``) and trusts only the system CA bundle. When only a connection string is
set, distload gives the reader its AccountName, AccountKey and EndpointSuffix.
"""

from __future__ import annotations

import os

from distload.loading.stores.base import (
    CONNECT_TIMEOUT_S,
    Endpoint,
    Listing,
    ObjectStore,
    ObjectURI,
    first_line,
    read_timeout,
)

DEFAULT_SUFFIX = "blob.core.windows.net"


class _NoAzureCredentials(Exception):
    pass


def parse_connection_string(text: str) -> dict[str, str]:
    parts = {}
    for item in text.split(";"):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            parts[key.strip()] = value.strip()
    return parts


class AzureStore(ObjectStore):
    scheme = "az"
    product = "Azure Blob"
    bucket_word = "container"
    credential_hint = ("check AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or "
                       "AZURE_STORAGE_SAS_TOKEN (or AZURE_STORAGE_CONNECTION_STRING, or an identity "
                       "DefaultAzureCredential can use), and the container's access policy")
    ENV_KEYS = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
                "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_ENDPOINT_SUFFIX", "AZURE_CLIENT_ID",
                "AZURE_TENANT_ID", "REQUESTS_CA_BUNDLE")

    needs = ("Run:ai's Azure reader and azure-storage-blob", "azure",
             ("azure.storage.blob", "runai_model_streamer_azure"))

    def __init__(self) -> None:
        super().__init__()
        env = os.environ
        self._connection = parse_connection_string(env.get("AZURE_STORAGE_CONNECTION_STRING", ""))
        self._account = env.get("AZURE_STORAGE_ACCOUNT_NAME") or self._connection.get("AccountName", "")
        suffix = env.get("AZURE_STORAGE_ENDPOINT_SUFFIX")
        if not suffix and self._connection.get("EndpointSuffix"):
            suffix = "blob." + self._connection["EndpointSuffix"]
        self._suffix = suffix or DEFAULT_SUFFIX

    def _make_client(self):
        from azure.storage.blob import BlobServiceClient, ExponentialRetry

        env = os.environ
        # The SDK's default retry waits 15 s, then 18 s more, between tries: a stalled server
        # would hold a load for a minute. Two retries after 1 s and 3 s, as the other stores.
        retry = ExponentialRetry(initial_backoff=1, increment_base=2, retry_total=2, random_jitter_range=1)
        kwargs = {"connection_timeout": CONNECT_TIMEOUT_S, "read_timeout": read_timeout(),
                  "retry_policy": retry, "user_agent": "distload"}
        account_url = f"https://{self._account}.{self._suffix}"
        if env.get("AZURE_STORAGE_CONNECTION_STRING"):
            client = BlobServiceClient.from_connection_string(env["AZURE_STORAGE_CONNECTION_STRING"], **kwargs)
        elif not self._account:
            raise _NoAzureCredentials(
                "neither AZURE_STORAGE_CONNECTION_STRING nor AZURE_STORAGE_ACCOUNT_NAME is set")
        elif env.get("AZURE_STORAGE_SAS_TOKEN"):
            client = BlobServiceClient(account_url, credential=env["AZURE_STORAGE_SAS_TOKEN"].lstrip("?"),
                                       **kwargs)
        elif env.get("AZURE_STORAGE_ACCOUNT_KEY"):
            client = BlobServiceClient(account_url, credential={
                "account_name": self._account, "account_key": env["AZURE_STORAGE_ACCOUNT_KEY"]}, **kwargs)
        else:
            from azure.identity import DefaultAzureCredential

            client = BlobServiceClient(account_url, credential=DefaultAzureCredential(), **kwargs)
        return client

    def endpoint(self) -> Endpoint:
        if os.environ.get("AZURE_STORAGE_CONNECTION_STRING"):
            blob_endpoint = self._connection.get("BlobEndpoint")
            if blob_endpoint:
                return Endpoint(blob_endpoint, "BlobEndpoint in AZURE_STORAGE_CONNECTION_STRING")
            protocol = self._connection.get("DefaultEndpointsProtocol", "https")
            return Endpoint(f"{protocol}://{self._account}.{self._suffix}",
                            "AccountName and EndpointSuffix in AZURE_STORAGE_CONNECTION_STRING")
        return self.reader_endpoint()

    def reader_endpoint(self) -> Endpoint:
        return Endpoint(f"https://{self._account or '<AZURE_STORAGE_ACCOUNT_NAME unset>'}.{self._suffix}",
                        "https://$AZURE_STORAGE_ACCOUNT_NAME.$AZURE_STORAGE_ENDPOINT_SUFFIX, where Run:ai's "
                        "reader connects")

    def reader_environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        if not os.environ.get("AZURE_STORAGE_ACCOUNT_NAME") and self._connection.get("AccountName"):
            env["AZURE_STORAGE_ACCOUNT_NAME"] = self._connection["AccountName"]
        if (not os.environ.get("AZURE_STORAGE_ACCOUNT_KEY") and not os.environ.get("AZURE_STORAGE_SAS_TOKEN")
                and self._connection.get("AccountKey")):
            env["AZURE_STORAGE_ACCOUNT_KEY"] = self._connection["AccountKey"]
        if not os.environ.get("AZURE_STORAGE_ENDPOINT_SUFFIX") and self._connection.get("EndpointSuffix"):
            env["AZURE_STORAGE_ENDPOINT_SUFFIX"] = "blob." + self._connection["EndpointSuffix"]
        return env

    def _list(self, location: ObjectURI, recursive: bool) -> Listing:
        listing = Listing()
        prefix = location.prefix
        container = self._client().get_container_client(location.bucket)
        items = (container.list_blobs(name_starts_with=prefix, include=["metadata"]) if recursive
                 else container.walk_blobs(name_starts_with=prefix, delimiter="/", include=["metadata"]))
        for item in items:
            name = item.name[len(prefix):]
            if not name:
                continue
            if name.endswith("/"):
                listing.folders.append(name)
            elif not _is_adls_directory(item):
                listing.objects[name] = int(item.size or 0)
                if getattr(item, "etag", None):
                    # A listing gives the ETag bare, a read or a stat in quotes (as HTTP sends
                    # it): the quoted form, the one the cache's entries and preconditions use.
                    etag = item.etag
                    listing.versions[name] = etag if etag.startswith('"') else f'"{etag}"'
        return listing

    def _blob(self, location: ObjectURI):
        return self._client().get_blob_client(location.bucket, location.key)

    def _read(self, location: ObjectURI, start: int, end: int) -> bytes:
        return self._blob(location).download_blob(offset=start, length=end - start).readall()

    def _read_version(self, location: ObjectURI, start: int, end: int, version: str) -> tuple[bytes, str | None]:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceModifiedError

        try:
            download = self._blob(location).download_blob(offset=start, length=end - start, etag=version,
                                                          match_condition=MatchConditions.IfNotModified)
        except ResourceModifiedError:
            return b"", self._stat(location)[1]
        return download.readall(), getattr(download.properties, "etag", None)

    def _read_head(self, location: ObjectURI, nbytes: int) -> tuple[bytes, int, str | None]:
        from azure.core.exceptions import HttpResponseError

        try:
            download = self._blob(location).download_blob(offset=0, length=nbytes)
        except HttpResponseError as exc:
            if getattr(exc, "error_code", None) == "InvalidRange":  # an empty blob
                return (b"",) + self._stat(location)
            raise
        data = download.readall()
        content_range = getattr(download.properties, "content_range", None) or ""
        size = int(content_range.rsplit("/", 1)[1]) if "/" in content_range else len(data)
        return data, size, getattr(download.properties, "etag", None)

    def _stat(self, location: ObjectURI) -> tuple[int, str | None]:
        properties = self._blob(location).get_blob_properties()
        return int(properties.size), properties.etag

    def _bucket_exists(self, bucket: str) -> bool:
        return bool(self._client().get_container_client(bucket).exists())

    def classify(self, exc: BaseException) -> tuple[str, str] | None:
        from azure.core import exceptions as ace

        if isinstance(exc, _NoAzureCredentials):
            return "no-credentials", str(exc)
        code = getattr(exc, "error_code", None)
        if isinstance(exc, ace.ResourceNotFoundError):
            if code == "ContainerNotFound":
                return "bucket-missing", str(code)
            if code == "BlobNotFound":
                return "object-missing", str(code)
            return "bucket-missing-or-object", first_line(str(exc))
        if isinstance(exc, ace.ClientAuthenticationError) or (
                isinstance(exc, ace.HttpResponseError) and getattr(exc, "status_code", None) in (401, 403)):
            if type(exc).__name__ == "CredentialUnavailableError":
                return "no-credentials", first_line(str(exc))
            return "access-denied", f"{code or 'HTTP ' + str(getattr(exc, 'status_code', ''))}: {first_line(str(exc))}"
        if isinstance(exc, (ace.ServiceRequestError, ace.ServiceResponseError)):
            return "unreachable", f"{type(exc).__name__}: {first_line(str(exc))}"
        if isinstance(exc, ace.AzureError):
            return "other", f"{type(exc).__name__} {code or ''}: {first_line(str(exc))}"
        return None


def _is_adls_directory(blob) -> bool:
    # Hierarchical-namespace accounts list directory stubs as empty blobs marked hdi_isfolder.
    metadata = getattr(blob, "metadata", None) or {}
    return not getattr(blob, "size", 0) and str(metadata.get("hdi_isfolder", metadata.get("Hdi_isfolder"))).lower() == "true"
