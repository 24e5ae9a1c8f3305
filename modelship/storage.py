"""S3/MinIO access: the one narrow client modelship uses for the object store.

botocore errors are translated here, at the boundary, into :class:`StorageError` and
:class:`Unreachable` whose messages name the endpoint, the bucket and the fix.

Retries: botocore's standard mode retries every call :data:`S3_ATTEMPTS` times in all
(with jittered exponential backoff) on the same failures that
:func:`modelship.faults.is_transient` calls transient: connection errors, timeouts,
throttling, 502/503/504. What still fails after that is marked ``retried``, so no outer
layer retries it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelship.errors import CredentialsRejected, StorageError, Unreachable
from modelship.faults import Breaker, is_transient, reason

if TYPE_CHECKING:
    from boto3.s3.transfer import TransferConfig
    from mypy_boto3_s3 import S3Client

# HEAD requests carry no error body, so a refusal shows up as a bare "403".
CREDENTIAL_ERRORS = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden",
}
#: Tries per S3 call, the first included (botocore's standard retry mode): at most 2 + 4 s
#: of backoff, so a dead endpoint costs seconds.
S3_ATTEMPTS = 3


class S3Storage:
    """A bucket on one S3 endpoint. The constructor does no I/O; the boto3 client is lazy.

    Args:
        endpoint: S3 endpoint URL, e.g. ``http://127.0.0.1:8333``.
        bucket: The bucket every key refers to.
        access_key: S3 access key id.
        secret_key: S3 secret key.
        region: Region name (SeaweedFS and MinIO accept any).
        timeout_s: Connect and read timeout of one request, in seconds.
        multipart_threshold_bytes: Files at least this big go up in parallel parts.
        multipart_chunk_bytes: Size of one part, in bytes.
    """

    def __init__(
        self,
        *,
        endpoint: str,
        bucket: str,
        access_key: str | None,
        secret_key: str | None,
        region: str = "us-east-1",
        timeout_s: float = 10.0,
        multipart_threshold_bytes: int = 64 * 1024 * 1024,
        multipart_chunk_bytes: int = 32 * 1024 * 1024,
    ) -> None:
        self.endpoint = endpoint
        self.bucket = bucket
        self._access_key = access_key
        self._secret_key = secret_key
        self._region = region
        self._timeout_s = timeout_s
        self._threshold = multipart_threshold_bytes
        self._chunk = multipart_chunk_bytes
        self._client: S3Client | None = None
        #: A hung endpoint is waited on once per cooldown, not once per call
        #: (:class:`modelship.faults.Breaker`); any answer closes it again.
        self.breaker = Breaker("S3")

    @property
    def client(self) -> S3Client:
        """The boto3 client; raises at once while the endpoint is known to be hung."""
        self.breaker.check()
        return self._built()

    def _built(self) -> S3Client:
        if self._client is None:
            # lazy: boto3 costs ~0.4 s at import; only an S3 call needs it
            import boto3
            from botocore.config import Config

            self._client = boto3.client(
                "s3",
                endpoint_url=self.endpoint,
                aws_access_key_id=self._access_key,
                aws_secret_access_key=self._secret_key,
                region_name=self._region,
                config=Config(
                    connect_timeout=self._timeout_s,
                    read_timeout=self._timeout_s,
                    retries={"total_max_attempts": S3_ATTEMPTS, "mode": "standard"},
                    s3={"addressing_style": "path"},
                    signature_version="s3v4",
                ),
            )
            self._client.meta.events.register("after-call.s3", self._answered)
        return self._client

    def warm(self) -> None:
        """Import boto3 and build the client, with no I/O (the breaker is not consulted): a
        caller that times S3's answer starts its clock after the local work."""
        self._built()

    def _answered(self, **_: Any) -> None:
        """botocore's after-call event: the endpoint answered (an error answer too)."""
        self.breaker.succeeded()

    def _translate(self, exc: Exception, action: str) -> Exception:
        # lazy: botocore only once S3 is called; the ledger imports this module without it
        from botocore.exceptions import (
            ClientError,
            ConnectionClosedError,
            EndpointConnectionError,
            NoCredentialsError,
            ReadTimeoutError,
        )

        transient = is_transient(exc)
        if isinstance(exc, Unreachable) and exc.details.get("breaker_open"):
            return Unreachable(f"S3 endpoint {self.endpoint} was not asked to {action}: "
                               f"{exc.message}", hint=exc.hint, **exc.details)
        if (transient and not isinstance(exc, ClientError)) or isinstance(
                exc, EndpointConnectionError | ConnectionClosedError | ReadTimeoutError):
            unreachable = Unreachable(
                f"S3 endpoint {self.endpoint} did not answer while trying to {action} "
                f"({reason(exc)})",
                hint="check that the S3 server is running (`modelship doctor`) and "
                "MODELSHIP_S3_ENDPOINT is right",
                endpoint=self.endpoint, transient=True, retried=S3_ATTEMPTS,
            )
            self.breaker.failed(exc, unreachable)
            return unreachable
        if isinstance(exc, NoCredentialsError):
            return StorageError(
                f"no S3 credentials are configured for {self.endpoint}",
                hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                endpoint=self.endpoint,
            )
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", "Unknown"))
            if code in CREDENTIAL_ERRORS:
                return CredentialsRejected(
                    f"S3 at {self.endpoint} refused the credentials ({code}) while trying to "
                    f"{action}",
                    hint="check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (the embedded "
                    "stack's are in .modelship/stack.json)",
                    endpoint=self.endpoint,
                    code=code,
                )
            if code in {"NoSuchBucket", "404"} and "bucket" in action:
                return StorageError(
                    f"bucket {self.bucket!r} does not exist at {self.endpoint}",
                    hint="create it, or set MODELSHIP_BUCKET to an existing bucket",
                    endpoint=self.endpoint,
                    code=code,
                )
            return StorageError(
                f"S3 at {self.endpoint} failed to {action}: {code}",
                hint="see the S3 server's log",
                endpoint=self.endpoint,
                code=code,
                **({"transient": True, "retried": S3_ATTEMPTS} if transient else {}),
            )
        return StorageError(f"S3 at {self.endpoint} failed to {action}: {exc}",
                            endpoint=self.endpoint)

    def ping(self) -> None:
        """Check the endpoint answers, the credentials work and the bucket exists."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            raise self._translate(exc, f"open bucket {self.bucket}") from exc

    def exists(self, key: str) -> bool:
        # lazy: botocore only once S3 is called; the ledger imports this module without it
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) in {"404", "NoSuchKey", "NotFound"}:
                return False
            raise self._translate(exc, f"read s3://{self.bucket}/{key}") from exc
        except Exception as exc:
            raise self._translate(exc, f"read s3://{self.bucket}/{key}") from exc

    def head(self, key: str) -> dict[str, Any] | None:
        """Object metadata (size, user metadata), or None when it does not exist."""
        # lazy: botocore only once S3 is called; the ledger imports this module without it
        from botocore.exceptions import ClientError

        try:
            response = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) in {"404", "NoSuchKey", "NotFound"}:
                return None
            raise self._translate(exc, f"read s3://{self.bucket}/{key}") from exc
        except Exception as exc:
            raise self._translate(exc, f"read s3://{self.bucket}/{key}") from exc
        return {"size": response["ContentLength"], "metadata": response.get("Metadata", {})}

    def put_bytes(self, key: str, data: bytes, *, metadata: dict[str, str] | None = None) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data,
                                   Metadata=metadata or {})
        except Exception as exc:
            raise self._translate(exc, f"write s3://{self.bucket}/{key}") from exc

    def get_bytes(self, key: str) -> bytes:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            return bytes(response["Body"].read())
        except Exception as exc:
            raise self._translate(exc, f"read s3://{self.bucket}/{key}") from exc

    def _transfer_config(
        self, threshold_bytes: int | None = None, chunk_bytes: int | None = None
    ) -> TransferConfig:
        """Managed-transfer settings: parallel parts above the threshold (sizes in bytes)."""
        # lazy: boto3 costs ~0.4 s at import; only an S3 call needs it
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=threshold_bytes or self._threshold,
            multipart_chunksize=chunk_bytes or self._chunk,
            max_concurrency=8,
            use_threads=True,
        )

    def upload_file(self, path: Path, key: str, *, metadata: dict[str, str] | None = None) -> None:
        """Upload a file, in parallel parts above the multipart threshold."""
        config = self._transfer_config()
        try:
            self.client.upload_file(str(path), self.bucket, key, Config=config,
                                    ExtraArgs={"Metadata": metadata or {}})
        except Exception as exc:
            raise self._translate(exc, f"upload {path} to s3://{self.bucket}/{key}") from exc

    def upload_file_parts(
        self,
        path: Path,
        key: str,
        *,
        metadata: dict[str, str] | None = None,
        multipart_threshold_bytes: int | None = None,
        multipart_chunk_bytes: int | None = None,
    ) -> None:
        """Upload a file with per-call part sizes (bytes), e.g. from a model's policy.

        Like :meth:`upload_file`, whose defaults come from the constructor; a multipart
        upload only becomes visible when it completes, so a reader never sees half a file.
        """
        config = self._transfer_config(multipart_threshold_bytes, multipart_chunk_bytes)
        try:
            self.client.upload_file(str(path), self.bucket, key, Config=config,
                                    ExtraArgs={"Metadata": metadata or {}})
        except Exception as exc:
            raise self._translate(exc, f"upload {path} to s3://{self.bucket}/{key}") from exc

    def copy_object(
        self,
        source_key: str,
        key: str,
        *,
        metadata: dict[str, str] | None = None,
        multipart_threshold_bytes: int | None = None,
        multipart_chunk_bytes: int | None = None,
    ) -> None:
        """Server-side copy inside the bucket: no bytes travel through this process.

        Uses boto3's managed copy, so objects above the threshold are copied in parallel
        parts (``UploadPartCopy``), which also lifts CopyObject's 5 GB limit.

        Args:
            source_key: The object to copy.
            key: The destination key; an existing object there is replaced.
            metadata: User metadata of the copy; None keeps the source's.
            multipart_threshold_bytes: Copy in parts at or above this size, in bytes.
            multipart_chunk_bytes: Size of one copied part, in bytes.
        """
        config = self._transfer_config(multipart_threshold_bytes, multipart_chunk_bytes)
        extra: dict[str, Any] = {"MetadataDirective": "COPY"}
        if metadata is not None:
            extra = {"MetadataDirective": "REPLACE", "Metadata": metadata}
        try:
            self.client.copy({"Bucket": self.bucket, "Key": source_key}, self.bucket, key,
                             ExtraArgs=extra, Config=config)
        except Exception as exc:
            raise self._translate(
                exc, f"copy s3://{self.bucket}/{source_key} to s3://{self.bucket}/{key}"
            ) from exc

    def iter_bytes(self, key: str, *, chunk_bytes: int = 8 * 1024 * 1024) -> Iterator[bytes]:
        """Stream an object in chunks of ``chunk_bytes`` (bytes), e.g. to hash a large file."""
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            yield from response["Body"].iter_chunks(chunk_size=chunk_bytes)
        except Exception as exc:
            raise self._translate(exc, f"read s3://{self.bucket}/{key}") from exc

    def delete_key(self, key: str) -> None:
        """Delete one object (S3 treats a missing key as deleted)."""
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            raise self._translate(exc, f"delete s3://{self.bucket}/{key}") from exc

    def list_keys(self, prefix: str) -> Iterator[str]:
        """Every key under ``prefix``."""
        try:
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    yield obj["Key"]
        except Exception as exc:
            raise self._translate(exc, f"list s3://{self.bucket}/{prefix}") from exc

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""
        keys = list(self.list_keys(prefix))
        try:
            for start in range(0, len(keys), 1000):
                chunk = keys[start:start + 1000]
                self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True},
                )
        except Exception as exc:
            raise self._translate(exc, f"delete s3://{self.bucket}/{prefix}") from exc
        return len(keys)
