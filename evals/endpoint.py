"""lm-eval's OpenAI-compatible clients with a retry rule that only repeats what may succeed.

lm-eval 0.4.13 retries every failed request ``max_retries`` times (``tenacity.retry`` around
``TemplateAPI.model_call`` and ``amodel_call`` in ``lm_eval/models/api_models.py``), whatever the
failure: a prompt too long for the server (HTTP 400) is sent again and again, and a request that
times out after minutes of generation is generated again from the start. Here lm-eval's own
retry is set to one attempt and these methods retry by themselves: connection errors, timeouts,
HTTP 408, 429 and 5xx, up to ``ATTEMPTS`` times with backoff; any other 4xx is the request's own
fault, so it is raised at once with the server's answer.
"""

from __future__ import annotations

import asyncio
import time

from lm_eval.api.registry import register_model
from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

ATTEMPTS = 5
RETRY_STATUS = {408, 429}  # and every 5xx


class RequestRejected(RuntimeError):
    """The server answered a 4xx that retrying cannot fix (too long a prompt, a bad parameter)."""


def retryable(status: int | None) -> bool:
    return status is None or status in RETRY_STATUS or status >= 500


def _backoff(attempt: int) -> float:
    return min(10.0, 0.5 * 2 ** attempt)  # lm-eval's own wait_exponential(multiplier=0.5, max=10)


class _RetryOnlyWhatMaySucceed:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "max_retries": 1})  # lm-eval's tenacity: one attempt

    def _wait_before_retry(self, attempt: int, status: int | None = None, answer: str = "") -> float | None:
        """The one retry rule for both clients: seconds to wait before the next attempt, or None
        when this was the last one (the caller re-raises); a 4xx retrying cannot fix is raised at
        once as ``RequestRejected`` with the server's answer. ``status`` None: no HTTP answer."""
        if not retryable(status):
            raise RequestRejected(f"{self.base_url} answered HTTP {status}: {answer}") from None
        return None if attempt == ATTEMPTS - 1 else _backoff(attempt)

    def model_call(self, *args, **kwargs):
        import requests

        for attempt in range(ATTEMPTS):
            try:
                return super().model_call(*args, **kwargs)
            except requests.HTTPError as exc:
                answer = " ".join(exc.response.text.split())[:300]
                if (wait := self._wait_before_retry(attempt, exc.response.status_code, answer)) is None:
                    raise
            except (requests.ConnectionError, requests.Timeout):
                if (wait := self._wait_before_retry(attempt)) is None:
                    raise
            time.sleep(wait)
        return None

    async def amodel_call(self, *args, **kwargs):
        import aiohttp

        for attempt in range(ATTEMPTS):
            try:
                return await super().amodel_call(*args, **kwargs)
            except aiohttp.ClientResponseError as exc:
                if (wait := self._wait_before_retry(attempt, exc.status, exc.message)) is None:
                    raise
            except (aiohttp.ClientError, asyncio.TimeoutError):
                if (wait := self._wait_before_retry(attempt)) is None:
                    raise
            await asyncio.sleep(wait)
        return None


@register_model("quantgate-local-completions")
class Completions(_RetryOnlyWhatMaySucceed, LocalCompletionsAPI):
    pass


@register_model("quantgate-local-chat-completions")
class ChatCompletions(_RetryOnlyWhatMaySucceed, LocalChatCompletion):
    pass
