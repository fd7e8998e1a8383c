"""The generation budget (``max_gen_toks``) that fits the model: its context minus the longest prompt.

Why it must fit: lm-eval 0.4.13's ``HFLM.generate_until`` (``lm_eval/models/huggingface.py``)
asserts ``max_gen_toks < max_length`` and left-truncates every prompt to ``max_length - max_gen_toks``
tokens, so an oversized budget either stops the run or silently cuts few-shot exemplars; an
OpenAI-compatible server (vLLM, sglang) answers HTTP 400 when prompt + ``max_tokens`` exceed its
context. Reasoning models need long budgets, so the default is large and capped here:

- local model: its context as lm-eval itself resolves it (``lm_eval.models.utils.resolve_max_length``:
  ``n_positions`` / ``max_position_embeddings`` / ``n_ctx`` of the config, else the tokenizer's
  ``model_max_length``, else 2048);
- server: ``max_model_len`` from ``GET /v1/models`` (the ``ModelCard`` of vLLM 0.33.0,
  ``vllm/entrypoints/serve/engine/protocol.py``, and of sglang 0.5.23,
  ``sglang/srt/entrypoints/openai/protocol.py``); a server that reports none gets the default.

Prompts are built by lm-eval itself (the task's ``build_all_requests`` with the run's few-shot seed)
and counted with the model's tokenizer; with no tokenizer for a server, by UTF-8 bytes, an upper
bound for byte-level BPE tokenizers (every token covers at least one byte).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from evals.errors import BadInput
from evals.probe import get_json

DEFAULT_MAX_GEN_TOKS = 16384  # reasoning models think long; lm-eval's own default of 256 cuts them off
FEWSHOT_SEED = 1234  # lm-eval's default few-shot seed (simple_evaluate's fewshot_random_seed), as the Wafer write-up ran it
CHAT_MARGIN_BYTES = 64  # room for a chat template's role markers when prompts are counted in bytes
log = logging.getLogger(__name__)


class BudgetError(BadInput):
    """The generation budget cannot fit the model's context; the message names both numbers and the flag."""


@dataclass(frozen=True)
class Budget:
    max_gen_toks: int
    context: int | None  # the model's context in tokens (None: the server did not say)
    longest_prompt: int | None  # tokens (or bytes, see ``counted_in``) of the longest prompt of the run
    counted_in: str  # "tokens" or "bytes"
    how: str  # one line for people: where the number came from

    def to_dict(self) -> dict:
        return asdict(self)


def local_context(model: str) -> int:
    """The context lm-eval's ``hf`` model will use for ``model`` (its own resolver, not a copy)."""
    from lm_eval.models.utils import resolve_max_length
    from transformers import AutoConfig, AutoTokenizer

    return resolve_max_length(AutoConfig.from_pretrained(model), AutoTokenizer.from_pretrained(model))


def server_context(base_url: str, model: str, timeout: float = 10.0) -> int | None:
    """``max_model_len`` the server reports for ``model`` on ``/v1/models``; None when it reports none."""
    url = base_url.rsplit("/v1", 1)[0] + "/v1/models"
    try:
        cards = get_json(url, timeout).get("data", [])  # bounded in time and size, no redirects: evals.probe
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("%s: could not read the server's context length (%s)", url, exc)
        return None
    cards = [c for c in cards if isinstance(c, dict)]
    mine = [c for c in cards if c.get("id") == model] or cards  # a server with one model may name it otherwise
    return next((n for c in mine if isinstance(n := c.get("max_model_len"), int) and n > 0), None)


def prompts(task, limit: int | None) -> list[str]:
    """Every prompt lm-eval will send for ``task`` (an lm-eval Task: ``evals.tasks.load``), built by
    lm-eval with the run's few-shot seed."""
    task.set_fewshot_seed(seed=FEWSHOT_SEED)
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    return [instance.args[0] for instance in task.instances]


def prompt_counter(tokenizer: str | None, chat: bool):
    """(count(prompt) -> int, unit): the tokenizer's count when there is one, else UTF-8 bytes."""
    if tokenizer is None:
        margin = CHAT_MARGIN_BYTES if chat else 0
        return (lambda text: len(text.encode()) + margin), "bytes"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    if chat and tok.chat_template:
        def count(text: str) -> int:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            return len(ids)
        return count, "tokens"
    return (lambda text: len(tok(text)["input_ids"])), "tokens"


def fit(requested: int | None, context: int | None, longest: int, counted_in: str) -> Budget:
    """The budget to use: ``requested`` if it fits, else the context left after the longest prompt."""
    if context is None:
        budget = requested or DEFAULT_MAX_GEN_TOKS
        how = "given" if requested else f"default {DEFAULT_MAX_GEN_TOKS} (the server reports no context length)"
        return Budget(budget, None, longest, counted_in, how)
    room = context - longest
    if room <= 0:
        raise BudgetError(f"the longest prompt is {longest} {counted_in} but the model's context is {context}: no "
                          f"room to generate; serve the model with a longer context (or use fewer items)")
    if requested is not None and requested > room:
        raise BudgetError(f"--max-gen-toks {requested} + the longest prompt ({longest} {counted_in}) exceeds the "
                          f"model's context ({context}); lower --max-gen-toks to at most {room}, or omit it to "
                          f"get the largest budget that fits")
    if requested is not None:
        return Budget(requested, context, longest, counted_in, "given")
    budget = min(DEFAULT_MAX_GEN_TOKS, room)
    how = (f"default {DEFAULT_MAX_GEN_TOKS}" if budget == DEFAULT_MAX_GEN_TOKS else
           f"context {context} - longest prompt {longest} {counted_in}")
    return Budget(budget, context, longest, counted_in, how)


__all__ = ["Budget", "BudgetError", "DEFAULT_MAX_GEN_TOKS", "FEWSHOT_SEED", "fit", "local_context", "prompt_counter",
           "prompts", "server_context"]
