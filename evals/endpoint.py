"""lm-eval's OpenAI-compatible clients with a retry rule that only repeats what may succeed.

lm-eval 0.4.13 retries every failed request ``max_retries`` times (``tenacity.retry`` around
``TemplateAPI.model_call`` and ``amodel_call`` in ``lm_eval/models/api_models.py``), whatever the
failure: a prompt too long for the server (HTTP 400) is sent again and again, and a request that
times out after minutes of generation is generated again from the start. Here lm-eval's own
retry is set to one attempt and these methods retry by themselves: connection errors, timeouts,
HTTP 408, 429 and 5xx, up to ``ATTEMPTS`` times with backoff; any other 4xx is the request's own
fault, so it is raised at once with the server's answer.

Both clients also bound what a server can do: no redirect is followed (lm-eval's ``requests``
and aiohttp would follow one to any host), the request timeout bounds the whole request (aiohttp's
``ClientTimeout(total=...)``; ``requests`` bounds each socket read, so a trickling server never
timed out), and an answer over ``MAX_BODY_BYTES`` is refused instead of read into memory.
"""

from __future__ import annotations

import asyncio
import copy

from lm_eval.api.registry import register_model
from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

from evals.errors import RunFailed

ATTEMPTS = 5
MAX_BODY_BYTES = 64 << 20  # one completion answer; ~100 kB for a 16k-token text with logprobs off
RETRY_STATUS = {408, 429}  # and every 5xx


class RequestRejected(RunFailed):
    """The server answered a 4xx that retrying cannot fix (too long a prompt, a bad parameter)."""


def retryable(status: int | None) -> bool:
    return status is None or status in RETRY_STATUS or status >= 500


def _backoff(attempt: int) -> float:
    return min(10.0, 0.5 * 2 ** attempt)  # lm-eval's own wait_exponential(multiplier=0.5, max=10)


class _Guarded:
    """``session.post`` as lm-eval's ``amodel_call`` uses it (``async with session.post(...) as
    response``), with no redirect followed and the body read here, at most ``MAX_BODY_BYTES``.
    The body is then left where aiohttp 3.x's ``ClientResponse.read`` keeps it (``_body``), so
    lm-eval's own ``response.json()`` / ``.text()`` parse it without reading more."""

    def __init__(self, session):
        self.session = session

    def post(self, url, **kwargs):
        return _GuardedPost(self.session.post(url, allow_redirects=False, **kwargs), url)


class _GuardedPost:
    def __init__(self, request, url: str):
        self.request, self.url = request, url

    async def __aenter__(self):
        response = await self.request.__aenter__()
        try:
            return await self._checked(response)
        except BaseException as exc:
            await self.request.__aexit__(type(exc), exc, exc.__traceback__)  # releases the connection
            raise

    async def _checked(self, response):
        import aiohttp

        if 300 <= response.status < 400:
            raise RequestRejected(f"{self.url} answered HTTP {response.status}, a redirect to "
                                  f"{response.headers.get('Location', '?')!r}; redirects are not followed: give the "
                                  "server's own address as --base-url")
        body = bytearray()
        async for chunk in response.content.iter_chunked(1 << 16):
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise RequestRejected(f"{self.url} answered more than {MAX_BODY_BYTES >> 20} MiB to one request; "
                                      "not an OpenAI-compatible server's answer")
        if response.status >= 400:  # the server's own words, for the error (aiohttp keeps only the reason)
            raise aiohttp.ClientResponseError(response.request_info, response.history, status=response.status,
                                              message=" ".join(body.decode(errors="replace").split())[:300],
                                              headers=response.headers)
        response._body = bytes(body)
        return response

    async def __aexit__(self, *exc):
        return await self.request.__aexit__(*exc)


class _RetryOnlyWhatMaySucceed:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "max_retries": 1})  # lm-eval's tenacity: one attempt

    def _wait_before_retry(self, attempt: int, exc: BaseException) -> float | None:
        """The one retry rule for both clients: seconds to wait before the next attempt, or None
        when this was the last one (the caller re-raises); a 4xx retrying cannot fix is raised at
        once as ``RequestRejected`` with the server's answer."""
        import aiohttp

        status = exc.status if isinstance(exc, aiohttp.ClientResponseError) else None  # None: no HTTP answer
        if not retryable(status):
            raise RequestRejected(f"{self.base_url} answered HTTP {status}: {exc.message}") from None
        return None if attempt == ATTEMPTS - 1 else _backoff(attempt)

    def model_call(self, messages, *, generate: bool = True, gen_kwargs: dict | None = None, **kwargs):
        """lm-eval's synchronous request (``TemplateAPI.model_call``: the same payload, ``eos`` included),
        sent through the same bounded client as the concurrent one: ``requests`` would follow
        redirects, read any size of body, and time out per socket read rather than per request."""
        payload = self._create_payload(self.create_message(messages), generate=generate,
                                       gen_kwargs=copy.deepcopy(gen_kwargs), seed=self._seed, eos=self.eos_string,
                                       **kwargs)
        return asyncio.run(self._post_with_retries(payload))

    async def _post_with_retries(self, payload: dict):
        import aiohttp

        connector = aiohttp.TCPConnector(ssl=self.verify_certificate)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout)) \
                as session:
            for attempt in range(ATTEMPTS):
                try:
                    async with _Guarded(session).post(self.base_url, json=payload, headers=self.header) as response:
                        response.raise_for_status()
                        return await response.json(content_type=None)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    if (wait := self._wait_before_retry(attempt, exc)) is None:
                        raise
                await asyncio.sleep(wait)
        return None

    async def amodel_call(self, session, *args, **kwargs):
        import aiohttp

        for attempt in range(ATTEMPTS):
            try:  # lm-eval's session has ClientTimeout(total=timeout): the whole request is bounded
                return await super().amodel_call(_Guarded(session), *args, **kwargs)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                if (wait := self._wait_before_retry(attempt, exc)) is None:
                    raise
            await asyncio.sleep(wait)
        return None


@register_model("quantgate-local-completions")
class Completions(_RetryOnlyWhatMaySucceed, LocalCompletionsAPI):
    pass


@register_model("quantgate-local-chat-completions")
class ChatCompletions(_RetryOnlyWhatMaySucceed, LocalChatCompletion):
    pass
