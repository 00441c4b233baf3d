"""The analyzer's HTTP API as the controller reads it: recommendations in, acknowledgements out.

`GET {analyzer}/api/v1/recommendations` serves `gpubalance.diagnosis.Recommendation`s as JSON
(a pydantic dump, mode="json"): a list, or an object holding it under `recommendations`. Each
is parsed with one `TypeAdapter`, so a change of shape is made here and nowhere else. Acks go
to `POST {analyzer}/api/v1/recommendations/{id}/ack` as `{status, reason, by}`. Both carry
`Authorization: Bearer <token>` when a token is given.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import aiohttp
from pydantic import TypeAdapter, ValidationError

from gpubalance.diagnosis import AckStatus, Recommendation

_RECOMMENDATIONS: TypeAdapter[list[Recommendation]] = TypeAdapter(list[Recommendation])


class AnalyzerError(RuntimeError):
    """The analyzer is unreachable, refused the request, or answered something unreadable."""


def parse_recommendations(body: bytes) -> list[Recommendation]:
    try:
        data: Any = json.loads(body)
    except json.JSONDecodeError as exc:
        raise AnalyzerError(f"recommendations are not JSON: {exc}") from exc
    if isinstance(data, dict) and "recommendations" in data:
        data = data["recommendations"]
    try:
        return _RECOMMENDATIONS.validate_python(data)
    except ValidationError as exc:
        raise AnalyzerError(f"recommendations do not have the expected shape: {exc}") from exc


class AnalyzerClient:
    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        *,
        token: str | None = None,
        timeout_seconds: float = 5.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)

    async def recommendations(self) -> list[Recommendation]:
        url = f"{self.base_url}/api/v1/recommendations"
        try:
            async with self._session.get(
                url, headers=self._headers, timeout=self._timeout
            ) as response:
                body = await response.read()
                if response.status != 200:
                    text = body[:200].decode(errors="replace")
                    raise AnalyzerError(f"GET {url} answered {response.status}: {text}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AnalyzerError(f"cannot reach the analyzer at {url}: {exc!r}") from exc
        return parse_recommendations(body)

    async def ack(self, recommendation_id: str, status: AckStatus, reason: str, by: str) -> None:
        url = f"{self.base_url}/api/v1/recommendations/{quote(recommendation_id, safe='')}/ack"
        try:
            async with self._session.post(
                url,
                json={"status": status, "reason": reason, "by": by},
                headers=self._headers,
                timeout=self._timeout,
            ) as response:
                if response.status >= 300:
                    text = (await response.read())[:200].decode(errors="replace")
                    raise AnalyzerError(f"POST {url} answered {response.status}: {text}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AnalyzerError(f"cannot reach the analyzer at {url}: {exc!r}") from exc
