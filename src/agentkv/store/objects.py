"""ObjectStore: the S3-compatible object store under a fleet of servers, in a few verbs.

boto3 (the optional extra ``agentkv[s3]``) does the talking: credentials, region, endpoint
(``AWS_ENDPOINT_URL`` for MinIO and other S3-compatible servers) and profiles come from the
standard environment and files. Every failure comes out as one of three exceptions, in the
user's words and naming no endpoint or credential:

- ``PreconditionFailed``: a conditional write lost (``If-Match`` / ``If-None-Match``);
- ``StoreUnavailable``: the store could not be reached, timed out, or failed (5xx, refused);
- ``ObjectMissing`` for a key that is not there (``head`` returns None instead).

Conditional writes are what orders the fleet: ``put(..., if_match=etag)`` writes only over that
version, ``put(..., if_none_match=True)`` only where nothing is.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from urllib.parse import urlparse

from ..errors import AgentKVError, InvalidRequestError

CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 15.0


class StoreUnavailable(AgentKVError):
    """The object store could not be reached or failed; what was asked did not happen (or
    may not have: a write is only ever retried as the same conditional write)."""


class StoreMisconfigured(StoreUnavailable):
    """The store answered but will not serve this bucket: it has no such bucket, or it
    refused the credentials. Waiting does not help; the setup must change."""


class PreconditionFailed(AgentKVError):
    """A conditional write found another version than the one it was conditioned on."""


class ObjectMissing(AgentKVError):
    """No object under that key."""


@dataclass(frozen=True)
class StoreURL:
    """``s3://bucket/prefix``: where a fleet's agents live."""

    bucket: str
    prefix: str  # no leading or trailing slash; may be empty

    @classmethod
    def parse(cls, url: str) -> StoreURL:
        parsed = urlparse(str(url))
        if parsed.scheme != "s3" or not parsed.netloc:
            raise InvalidRequestError(
                f"store {url!r} is not an s3://bucket/prefix URL (a local directory is --cache-dir)"
            )
        if parsed.query or parsed.fragment or "@" in parsed.netloc:
            raise InvalidRequestError(
                f"store {url!r}: give s3://bucket/prefix only; credentials and the endpoint "
                "come from the AWS environment variables"
            )
        return cls(parsed.netloc, parsed.path.strip("/"))

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


@dataclass(frozen=True)
class Head:
    """What a ``HEAD`` says of an object."""

    etag: str
    size: int
    metadata: dict


@dataclass(frozen=True)
class Listed:
    """One object of a listing."""

    key: str
    size: int
    modified: float  # seconds since the epoch


@dataclass
class Traffic:
    """Requests by (op, outcome) and bytes by direction, since the store was opened."""

    requests: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=lambda: {"up": 0, "down": 0})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, op: str, outcome: str, *, up: int = 0, down: int = 0) -> None:
        with self._lock:
            self.requests[(op, outcome)] = self.requests.get((op, outcome), 0) + 1
            self.bytes["up"] += up
            self.bytes["down"] += down

    def snapshot(self) -> tuple[dict, dict]:
        with self._lock:
            return dict(self.requests), dict(self.bytes)


class ObjectStore:
    """One bucket (and prefix) of an S3-compatible store; thread-safe."""

    def __init__(self, url: str | StoreURL, *, client=None):
        self.url = url if isinstance(url, StoreURL) else StoreURL.parse(url)
        self.traffic = Traffic()
        self._client = client or _client()
        from botocore.exceptions import ClientError

        self._client_error = ClientError

    # -- the verbs ----------------------------------------------------------------------

    def head(self, key: str) -> Head | None:
        try:
            r = self._call("head", self._client.head_object, Key=self.url.key(key))
        except ObjectMissing:
            return None
        return Head(r["ETag"], int(r.get("ContentLength", 0)), dict(r.get("Metadata") or {}))

    def get(self, key: str) -> tuple[bytes, Head]:
        """The object's bytes and what its ``HEAD`` would say; ObjectMissing if absent."""
        r = self._call("get", self._client.get_object, Key=self.url.key(key))
        try:
            data = r["Body"].read()
        except Exception as exc:  # the connection broke while reading
            self.traffic.count("get", "unavailable")
            raise StoreUnavailable(f"the agent store {self.url} broke off a read ({exc})") from None
        self.traffic.count("get", "ok", down=len(data))
        return data, Head(r["ETag"], len(data), dict(r.get("Metadata") or {}))

    def put(
        self,
        key: str,
        data: bytes,
        *,
        if_match: str | None = None,
        if_none_match: bool = False,
        metadata: dict | None = None,
    ) -> str:
        """Write ``data`` under ``key``; its new ETag. ``if_match``: only over that version;
        ``if_none_match``: only where there is none (PreconditionFailed otherwise)."""
        args = {"Key": self.url.key(key), "Body": data, "Metadata": metadata or {}}
        if if_match is not None:
            args["IfMatch"] = if_match
        if if_none_match:
            args["IfNoneMatch"] = "*"
        r = self._call("put", self._client.put_object, counted=False, **args)
        self.traffic.count("put", "ok", up=len(data))
        return r["ETag"]

    def delete(self, key: str) -> None:
        self._call("delete", self._client.delete_object, Key=self.url.key(key))

    def keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (relative to the store's prefix)."""
        return [item.key for item in self.listing(prefix)]

    def listing(self, prefix: str) -> list[Listed]:
        """Every object under ``prefix``: its key (relative to the store's prefix), size and
        when it was last written."""
        base = f"{self.url.prefix}/" if self.url.prefix else ""
        full, start = base + prefix, len(base)
        out, token = [], None
        while True:
            args = {"Prefix": full}
            if token:
                args["ContinuationToken"] = token
            r = self._call("list", self._client.list_objects_v2, **args)
            out += [
                Listed(item["Key"][start:], int(item.get("Size", 0)),
                       item["LastModified"].timestamp())
                for item in r.get("Contents", ())
            ]  # fmt: skip
            if not r.get("IsTruncated"):
                return out
            token = r["NextContinuationToken"]

    def ping(self) -> None:
        """Raise StoreUnavailable unless the bucket answers."""
        self._call("ping", self._client.head_bucket, bucket_only=True)

    # -- errors in one vocabulary ------------------------------------------------------

    def _call(self, op: str, fn, *, counted: bool = True, bucket_only: bool = False, **args):
        from botocore.exceptions import BotoCoreError

        try:
            result = fn(Bucket=self.url.bucket, **args)
        except self._client_error as exc:
            error = exc.response.get("Error", {})
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            code = str(error.get("Code", status))
            if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                self.traffic.count(op, "conflict")
                raise PreconditionFailed(f"{op}: the store holds another version") from None
            if status == 404 or code in ("NoSuchKey", "404", "NotFound"):
                if code == "NoSuchBucket" or bucket_only:
                    self.traffic.count(op, "unavailable")
                    raise StoreMisconfigured(
                        f"the agent store {self.url} has no bucket {self.url.bucket!r}"
                    ) from None
                self.traffic.count(op, "missing")
                raise ObjectMissing(args.get("Key", "")) from None
            self.traffic.count(op, "unavailable")
            if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId"):
                raise StoreMisconfigured(
                    f"the agent store {self.url} refused access ({code}): check the AWS credentials"
                ) from None
            raise StoreUnavailable(f"the agent store {self.url} failed ({code})") from None
        except (BotoCoreError, OSError) as exc:
            self.traffic.count(op, "unavailable")
            raise StoreUnavailable(
                f"the agent store {self.url} could not be reached ({type(exc).__name__})"
            ) from None
        if counted:
            self.traffic.count(op, "ok")
        return result


def require_client() -> None:
    """InvalidRequestError unless boto3 (the ``agentkv[s3]`` extra) is installed."""
    try:
        import boto3  # noqa: F401
    except ImportError:
        raise InvalidRequestError("an s3:// store needs boto3: pip install 'agentkv[s3]'") from None


def _client():
    """A boto3 S3 client from the standard AWS environment, with short timeouts: a store
    that does not answer costs a turn seconds, not minutes."""
    import os

    require_client()
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
        retries={"max_attempts": 2, "mode": "standard"},
        max_pool_connections=32,
        # every byte fetched is checked against the agent's manifest (remote.check_file):
        # botocore's CRC-32 of each response on top cost CPU on the turn's path
        response_checksum_validation="when_required",
        # an S3-compatible server on an address of its own (MinIO, Ceph) takes paths
        s3={"addressing_style": "path" if _custom_endpoint(os.environ) else "auto"},
    )
    return boto3.session.Session().client("s3", config=config)


def _custom_endpoint(env) -> bool:
    return bool(env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"))
