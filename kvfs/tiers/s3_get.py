"""GETs of L4 objects without the S3 client's per-call machinery: signed by botocore's own SigV4 signer and sent
on the client's own HTTP session (its connection pools, TLS settings, proxies and timeouts).

Why: a boto3 `get_object` spends ~1.2 ms of CPU per call in parameter validation, endpoint rules, event hooks
and response parsing, before a byte of the body moves; this path spends ~0.5 ms (measured on RGW, one thread).
For KV files of 2-3 MB stored that is 0.3 ms per MB of a promotion, on a host where the mover, the readers and
often the store share the cores. Everything else (PUTs, multipart, HEAD, LIST, DELETE) stays on the client.

The URL is the one the client itself would use: the part before the key of a URL it presigns (path-style or
virtual-host, custom endpoint or AWS's regional one). Failures come out as botocore's own exceptions
(ClientError with the store's error code, EndpointConnectionError, ReadTimeoutError, ...; urllib3's for a
body cut short), so the tier sorts them as it sorts the client's. Retries follow the client's attempts with
exponential backoff and jitter, on what botocore's standard mode retries: connection failures, timeouts, 5xx,
429, and the throttling and request-timeout codes. A redirect (AWS: the bucket lives in another region
than the one configured) is not followed here: the tier then sends its GETs through the client, which is.
"""

from __future__ import annotations

import random
import re
import time
import urllib.parse

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.exceptions import ClientError, ConnectionError, HTTPClientError
from botocore.utils import percent_encode
from urllib3.exceptions import HTTPError as TransportError

_PROBE = "kvfs-probe-key"
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_RETRY_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                          "ServiceUnavailable", "RequestTimeoutException", "PriorRequestNotComplete"})
_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")
_BACKOFF_CAP_S = 2.0  # the call's deadline (Store.io) bounds the whole; no single sleep may take most of it


class DirectGet:
    """Whole and ranged GETs of one bucket's keys, as bytes."""

    def __init__(self, client, credentials, bucket: str, attempts: int) -> None:
        presigned = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": _PROBE},
                                                  ExpiresIn=60)
        url = urllib.parse.urlsplit(presigned)
        if not url.path.endswith(_PROBE):
            raise ValueError(f"cannot tell the object URL layout from {url.scheme}://{url.netloc}{url.path}")
        self._base = f"{url.scheme}://{url.netloc}{url.path[:-len(_PROBE)]}"
        self._session = client._endpoint.http_session  # the client's pools: one set of connections for both
        self._credentials = credentials  # None: anonymous (unsigned) requests
        self._region = client.meta.region_name or "us-east-1"
        self._attempts = max(1, attempts)

    def get(self, key: str, first: int | None = None, last: int | None = None) -> bytes:
        """The object's bytes, or bytes first..last (inclusive) of it. Raises ClientError (NoSuchKey,
        InvalidRange, AccessDenied, ...) or botocore's connection errors after the last attempt."""
        headers = {} if first is None else {"Range": f"bytes={first}-{last}"}
        for attempt in range(self._attempts):
            try:
                return self._once(key, headers)
            except (ClientError, ConnectionError, HTTPClientError, TransportError) as e:
                if attempt + 1 == self._attempts or not _retryable(e):
                    raise
            time.sleep(min(_BACKOFF_CAP_S, random.random() * 0.05 * 2 ** attempt))
        raise AssertionError("unreachable")

    def _once(self, key: str, headers: dict[str, str]) -> bytes:
        request = AWSRequest(method="GET", url=self._base + percent_encode(key, safe="/~"), headers=headers)
        if self._credentials is not None:
            S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3", self._region).add_auth(request)
        prepared = request.prepare()
        prepared.stream_output = True  # the body is read below, once, as one buffer
        response = self._session.send(prepared)
        raw = response.raw
        try:
            body = raw.read()
        finally:
            raw.release_conn()
        if response.status_code in (200, 206):
            expected = response.headers.get("Content-Length")
            if expected is not None and int(expected) != len(body):
                raise ConnectionError(error=f"GET {key}: {len(body)} bytes of {expected} (connection cut)")
            return body
        raise _client_error(response.status_code, body, key)


def _client_error(status: int, body: bytes, key: str) -> ClientError:
    found = _CODE.search(body)
    code = found.group(1).decode("ascii", "replace") if found else {404: "NoSuchKey", 416: "InvalidRange"}.get(
        status, str(status))
    return ClientError({"Error": {"Code": code, "Message": f"HTTP {status} for {key}"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def _retryable(e: Exception) -> bool:
    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status in _RETRY_STATUS or e.response.get("Error", {}).get("Code") in _RETRY_CODES
    return True  # connection refused or reset, timeouts: botocore's standard mode retries them too
