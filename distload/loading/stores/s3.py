"""Amazon S3 and S3-compatible stores (MinIO, Ceph, s3rver, moto, ...), with boto3.

Configured as Run:ai's S3 reader is: the standard AWS variables and credential chain,
``AWS_ENDPOINT_URL`` for another endpoint (the legacy ``RUNAI_STREAMER_S3_ENDPOINT`` too),
``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING`` (distload sets it to 0, path-style, when the endpoint
is not AWS and it is unset), ``RUNAI_STREAMER_S3_UNSIGNED=1`` for public buckets.
"""

from __future__ import annotations

import os
import urllib.parse

from distload.loading.stores.base import (
    CONNECT_TIMEOUT_S,
    Endpoint,
    Listing,
    ObjectStore,
    ObjectURI,
    READ_TIMEOUT_VARIABLE,
    first_line,
    is_aws_host,
    read_timeout,
)

_DENIED_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                 "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem",
                 "Forbidden", "403", "401", "Unauthorized"}


def s3_endpoint_setting(environ=os.environ) -> tuple[str | None, str]:
    if environ.get("AWS_ENDPOINT_URL"):
        return environ["AWS_ENDPOINT_URL"], "AWS_ENDPOINT_URL"
    if environ.get("RUNAI_STREAMER_S3_ENDPOINT"):
        return environ["RUNAI_STREAMER_S3_ENDPOINT"], "RUNAI_STREAMER_S3_ENDPOINT"
    return None, ""


def is_custom_endpoint(url: str | None) -> bool:
    """An endpoint that is not AWS (a local or S3-compatible server): it needs path-style URLs."""
    if not url:
        return False
    return not is_aws_host(urllib.parse.urlsplit(url if "://" in url else f"http://{url}").hostname or "")


class S3Store(ObjectStore):
    scheme = "s3"
    product = "S3"
    bucket_word = "bucket"
    credential_hint = ("check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or "
                       "AWS_PROFILE, and the bucket policy; for a public bucket set "
                       "RUNAI_STREAMER_S3_UNSIGNED=1 (requests are then sent unsigned)")
    ENV_KEYS = ("AWS_ENDPOINT_URL", "RUNAI_STREAMER_S3_ENDPOINT", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING",
                "RUNAI_STREAMER_S3_UNSIGNED", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_CA_BUNDLE")

    needs = ("boto3 and Run:ai's S3 reader", "s3", ("boto3", "botocore"))

    def __init__(self) -> None:
        super().__init__()
        self._endpoint_url, self._endpoint_origin = s3_endpoint_setting()

    # -- configuration -------------------------------------------------------------------------
    def _path_style(self) -> bool:
        setting = os.environ.get("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING")
        if setting is not None:
            return setting == "0"
        return is_custom_endpoint(self._endpoint_url)

    def _make_client(self):
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config

        kwargs = {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": read_timeout(),
                  "retries": {"max_attempts": 3, "mode": "standard"}}
        if self._path_style():
            kwargs["s3"] = {"addressing_style": "path"}
        if os.environ.get("RUNAI_STREAMER_S3_UNSIGNED") == "1":
            kwargs["signature_version"] = UNSIGNED
        return boto3.session.Session(botocore_session=self._credential_session()).client(
            "s3", endpoint_url=self._endpoint_url, config=Config(**kwargs))

    def _credential_session(self):
        """botocore's session, whose credential chain the client resolves."""
        import botocore.session

        core = botocore.session.Session()
        if is_custom_endpoint(self._endpoint_url) and "AWS_EC2_METADATA_DISABLED" not in os.environ:
            # No EC2 instance-metadata probe for a non-AWS endpoint (it would go to
            # 169.254.169.254 and wait for a timeout), unless the user said otherwise: the same
            # rule as the reader's AWS_EC2_METADATA_DISABLED in reader_environment.
            core.get_component("credential_provider").remove("iam-role")
        return core

    def endpoint(self) -> Endpoint:
        if self._endpoint_url:
            return Endpoint(self._endpoint_url, self._endpoint_origin)
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            return Endpoint(f"https://s3.{region}.amazonaws.com", f"AWS's default for region {region}")
        return Endpoint("https://s3.amazonaws.com", "AWS's default; no AWS_ENDPOINT_URL set")

    def reader_environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        # Run:ai 0.17 reads only AWS_ENDPOINT_URL; older docs (and older vLLM) use
        # RUNAI_STREAMER_S3_ENDPOINT. The one the user set gives the other its value.
        if self._endpoint_url and self._endpoint_origin == "AWS_ENDPOINT_URL":
            if not os.environ.get("RUNAI_STREAMER_S3_ENDPOINT"):
                env["RUNAI_STREAMER_S3_ENDPOINT"] = self._endpoint_url
        elif self._endpoint_url and not os.environ.get("AWS_ENDPOINT_URL"):
            env["AWS_ENDPOINT_URL"] = self._endpoint_url
        if os.environ.get(READ_TIMEOUT_VARIABLE) and "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS" not in os.environ:
            # Run:ai's stall timeout: a request that moves (almost) no bytes for this long fails.
            env["RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS"] = str(max(1, round(read_timeout() * 1000)))
        if is_custom_endpoint(self._endpoint_url):
            # Run:ai's reader builds virtual-host URLs (bucket.host) unless told otherwise, which a
            # local or S3-compatible server does not answer; and the EC2 metadata probe is pointless.
            if "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING" not in os.environ:
                env["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"
            if "AWS_EC2_METADATA_DISABLED" not in os.environ:
                env["AWS_EC2_METADATA_DISABLED"] = "true"
        return env

    # -- requests ------------------------------------------------------------------------------
    def _list(self, location: ObjectURI, recursive: bool) -> Listing:
        listing = Listing()
        prefix = location.prefix
        paginator = self._client().get_paginator("list_objects_v2")
        delimiter = {} if recursive else {"Delimiter": "/"}
        for page in paginator.paginate(Bucket=location.bucket, Prefix=prefix, **delimiter):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix):]
                if name and not name.endswith("/"):
                    listing.objects[name] = int(obj["Size"])
                    if obj.get("ETag"):
                        listing.versions[name] = obj["ETag"]
            for sub in page.get("CommonPrefixes", []):
                listing.folders.append(sub["Prefix"][len(prefix):])
        return listing

    def _read(self, location: ObjectURI, start: int, end: int) -> bytes:
        response = self._client().get_object(Bucket=location.bucket, Key=location.key,
                                              Range=f"bytes={start}-{end - 1}")
        return response["Body"].read()

    def _read_version(self, location: ObjectURI, start: int, end: int, version: str) -> tuple[bytes, str | None]:
        from botocore.exceptions import ClientError

        try:
            response = self._client().get_object(Bucket=location.bucket, Key=location.key,
                                                  Range=f"bytes={start}-{end - 1}", IfMatch=version)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "PreconditionFailed":
                return b"", self._stat(location)[1]
            raise
        return response["Body"].read(), response.get("ETag")

    def _read_head(self, location: ObjectURI, nbytes: int) -> tuple[bytes, int, str | None]:
        from botocore.exceptions import ClientError

        try:
            response = self._client().get_object(Bucket=location.bucket, Key=location.key,
                                                  Range=f"bytes=0-{nbytes - 1}")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":  # an empty object
                return (b"",) + self._stat(location)
            raise
        data = response["Body"].read()
        content_range = response.get("ContentRange") or ""
        size = int(content_range.rsplit("/", 1)[1]) if "/" in content_range else len(data)
        return data, size, response.get("ETag")

    def _stat(self, location: ObjectURI) -> tuple[int, str | None]:
        head = self._client().head_object(Bucket=location.bucket, Key=location.key)
        return int(head["ContentLength"]), head.get("ETag")

    def _bucket_exists(self, bucket: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client().head_bucket(Bucket=bucket)
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if status == 404 or code in ("404", "NoSuchBucket", "NotFound"):
                return False
        return True

    def classify(self, exc: BaseException) -> tuple[str, str] | None:
        from botocore import exceptions as bce

        if isinstance(exc, bce.NoCredentialsError):
            return "no-credentials", "boto3 found none in the environment, the config files or the instance metadata"
        if isinstance(exc, (bce.EndpointConnectionError, bce.ConnectTimeoutError, bce.ConnectionClosedError,
                            bce.ReadTimeoutError, bce.ProxyConnectionError)):
            return "unreachable", first_line(str(exc))
        if isinstance(exc, bce.ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            detail = f"{code}: {error.get('Message') or 'HTTP ' + str(status)}"
            if code == "NoSuchBucket":
                return "bucket-missing", detail
            if code == "NoSuchKey":
                return "object-missing", detail
            if code in ("404", "NotFound") or status == 404:
                return "bucket-missing-or-object", detail
            if code in _DENIED_CODES or status in (401, 403):
                return "access-denied", detail
            return "other", f"HTTP {status} {detail}"
        if isinstance(exc, bce.BotoCoreError):
            return "other", f"{type(exc).__name__}: {first_line(str(exc))}"
        return None
