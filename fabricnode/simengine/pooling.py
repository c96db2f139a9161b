"""vLLM 0.32's pooling endpoints (``vllm/entrypoints/pooling``) and its tokenizer endpoints
(``vllm/entrypoints/serve/tokenize``), on the simulated engine's token model.

Every pooling input is run through the engine as a prefill (one request a prompt, one token
sampled and dropped: a pooling model's forward pass), so the batch, the KV cache and the metrics
feel it as they feel a chat request. Scores and vectors are pure functions of the text:

* ``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``: ``query``, ``documents`` (strings),
  ``top_n`` (0: all) → ``{"id": "score-...", "model", "usage", "results": [{"index",
  "document": {"text", "multi_modal"}, "relevance_score"}]}``, best first (ties in document
  order). A (query, document) pair is one prompt, as for a cross-encoder.
* ``POST /score``, ``/v1/score``: ``queries``/``documents``, ``queries``/``items``,
  ``data_1``/``data_2`` or ``text_1``/``text_2``, each a string or a list, paired 1:1, 1:N or
  N:N (vLLM's errors otherwise) → ``{"object": "list", "data": [{"index", "object": "score",
  "score"}], "usage"}``.
* The relevance score is the word overlap of the pair (Jaccard over lower-cased words, in
  0..1): the more words a document shares with the query, the higher it ranks.
* ``POST /pooling``: ``input`` (string, strings, token ids) or ``messages``, ``task``
  (``embed`` by default: the ``/v1/embeddings`` vector of the text; ``classify``;
  ``token_embed``/``token_classify``: one row a token) → ``{"object": "list", "data":
  [{"index", "object": "pooling", "data"}], "usage"}``.
* ``POST /classify``: ``input`` or ``messages`` → ``{"data": [{"index", "label", "probs",
  "num_classes"}], ...}`` with two classes, ``LABEL_0``/``LABEL_1``.
* ``POST /tokenize``: ``prompt`` or ``messages`` (``add_generation_prompt`` default true, as the
  chat endpoint renders it; ``return_token_strs``) → ``{"count", "max_model_len", "tokens",
  "token_strs"}``: the very tokens and count the generation endpoints' ``usage`` reports.
* ``POST /detokenize``: ``tokens`` → ``{"prompt"}``, through the engine's output vocabulary: the
  ids a generation produces decode to the text it sent. (The toy tokenizer hashes words into the
  vocabulary, so a prompt's ids do not decode back to the prompt, unlike a real tokenizer.)
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from fabricnode.asgi import Send
from fabricnode.simengine.generation import GENERATION_PROMPT, Generator, chat_prompt, render_chat
from fabricnode.simengine.httpio import HttpError, Json, send_json
from fabricnode.simengine.lora import Models, Served
from fabricnode.simengine.model import VOCAB_SIZE, detokenize, embedding, tokenize, words

CLASS_LABELS = ("LABEL_0", "LABEL_1")
POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")


def random_hex() -> str:
    return uuid.uuid4().hex


def _bad(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, 400, param, kind="BadRequestError")


def relevance(query: str, document: str) -> float:
    """Word overlap of two texts: |common words| / |all words|, lower-cased, in 0..1."""
    a = {w.lower() for w in words(query) if w[0].isalnum() or w[0] == "_"}
    b = {w.lower() for w in words(document) if w[0].isalnum() or w[0] == "_"}
    union = a | b
    return len(a & b) / len(union) if union else 0.0


def class_probs(seed: int, text: str) -> list[float]:
    """A deterministic two-class distribution for ``text``."""
    h = hashlib.blake2b(text.encode(), digest_size=8, key=seed.to_bytes(8, "big", signed=True))
    x = (int.from_bytes(h.digest(), "big") >> 11) / float(1 << 53)
    logit = 4.0 * x - 2.0
    p1 = 1.0 / (1.0 + math.exp(-logit))
    return [1.0 - p1, p1]


def _texts(value: object, param: str) -> list[str]:
    """A string or a list of strings (vLLM's ScoreInput, text only)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        raise _bad(f"'{param}': multimodal inputs are not supported by the simulated engine", param)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise _bad(f"'{param}' must be a string or a list of strings", param)


def _usage(prompt_tokens: int) -> Json:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


class PoolingAPI:
    def __init__(
        self,
        models: Models,
        generator: Generator,
        *,
        seed: int,
        embedding_dims: int,
        wall_clock: Callable[[], float],
        new_id: Callable[[], str] = random_hex,
    ) -> None:
        self.models = models
        self.generator = generator
        self.seed = seed
        self.embedding_dims = embedding_dims
        self.wall_clock = wall_clock
        self.new_id = new_id

    async def _prefill(self, prompts: Sequence[list[int]], served: Served) -> None:
        """Run every prompt through the engine together (one sampled token each, dropped)."""
        submitted: list[Any] = []
        try:
            for prompt in prompts:
                submitted.append(self.generator.submit(prompt, 1, served))
            for _, tokens in submitted:
                async for _ in tokens:
                    pass
        finally:
            for rid, _ in submitted:
                self.generator.driver.abort(rid)

    # -- scoring --

    async def rerank(self, request: Json, send: Send) -> None:
        served = self.models.resolve(request.get("model"))
        query = request.get("query")
        if not isinstance(query, str):
            raise _bad("'query' must be a string", "query")
        documents = _texts(request.get("documents"), "documents")
        top_n = request.get("top_n", 0)
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
            raise _bad("'top_n' must be a non-negative integer", "top_n")
        if not documents:
            raise _bad("At least one text_pair element must be given", "documents")
        prompts = [tokenize(query) + tokenize(doc) for doc in documents]
        await self._prefill(prompts, served)
        scores = [relevance(query, doc) for doc in documents]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])  # stable: ties in order
        results: list[Json] = [
            {
                "index": i,
                "document": {"text": documents[i], "multi_modal": None},
                "relevance_score": scores[i],
            }
            for i in order
        ]
        if 0 < top_n < len(results):
            results = results[:top_n]
        used = sum(len(p) for p in prompts)
        doc = {
            "id": f"score-{self.new_id()}",
            "model": served.name,
            "usage": {"prompt_tokens": used, "total_tokens": used},
            "results": results,
        }
        await send_json(send, doc)

    async def score(self, request: Json, send: Send) -> None:
        served = self.models.resolve(request.get("model"))
        for first, second in (
            ("queries", "documents"),
            ("queries", "items"),
            ("data_1", "data_2"),
            ("text_1", "text_2"),
        ):
            if first in request and second in request:
                left = _texts(request[first], first)
                right = _texts(request[second], second)
                break
        else:
            raise _bad(
                "a score request needs queries and documents (or queries/items, data_1/data_2, "
                "text_1/text_2)"
            )
        if len(left) > 1 and len(left) != len(right):
            raise _bad("Input lengths must be either 1:1, 1:N or N:N")
        if not left:
            raise _bad("At least one text element must be given")
        if not right:
            raise _bad("At least one text_pair element must be given")
        pairs = [(left[0] if len(left) == 1 else left[i], r) for i, r in enumerate(right)]
        prompts = [tokenize(q) + tokenize(d) for q, d in pairs]
        await self._prefill(prompts, served)
        doc = {
            "id": f"score-{self.new_id()}",
            "object": "list",
            "created": int(self.wall_clock()),
            "model": served.name,
            "data": [
                {"index": i, "object": "score", "score": relevance(q, d)}
                for i, (q, d) in enumerate(pairs)
            ],
            "usage": _usage(sum(len(p) for p in prompts)),
        }
        await send_json(send, doc)

    # -- pooling and classification --

    def _inputs(self, request: Json) -> list[tuple[str, list[int]]]:
        """(text, prompt tokens) of each input of a pooling/classify request."""
        if "messages" in request:
            messages = request["messages"]
            if not isinstance(messages, list) or not messages:
                raise _bad("'messages' must be a non-empty list", "messages")
            add = request.get("add_generation_prompt", False) is True
            text = render_chat(messages) + (GENERATION_PROMPT if add else "")
            return [(text, tokenize(text))]
        raw = request.get("input")
        if isinstance(raw, str):
            return [(raw, tokenize(raw))]
        if isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
            return [(x, tokenize(x)) for x in raw]
        if isinstance(raw, list) and raw and all(_is_token(x) for x in raw):
            return [(_ids_text(raw), list(raw))]
        if (
            isinstance(raw, list)
            and raw
            and all(isinstance(x, list) and x and all(_is_token(t) for t in x) for x in raw)
        ):
            return [(_ids_text(x), list(x)) for x in raw]
        raise _bad(
            "'input' must be a string, a list of strings, a list of token ids or a list of them",
            "input",
        )

    async def pooling(self, request: Json, send: Send) -> None:
        served = self.models.resolve(request.get("model"))
        task = request.get("task") or "embed"
        if task not in POOLING_TASKS:
            raise _bad(f"task {task!r} is not supported (supported: {', '.join(POOLING_TASKS)})")
        inputs = self._inputs(request)
        await self._prefill([p for _, p in inputs], served)
        dims = self.embedding_dims
        data: list[Json] = []
        for i, (text, prompt) in enumerate(inputs):
            pooled: Any
            if task == "embed":
                pooled = embedding(self.seed, text, dims)
            elif task == "classify":
                pooled = class_probs(self.seed, text)
            else:
                pieces = (
                    words(text) if len(words(text)) == len(prompt) else [str(t) for t in prompt]
                )
                if task == "token_embed":
                    pooled = [embedding(self.seed, p, dims) for p in pieces]
                else:
                    pooled = [class_probs(self.seed, p) for p in pieces]
            data.append({"index": i, "object": "pooling", "data": pooled})
        await send_json(send, self._list_doc("pool", served.name, data, inputs))

    async def classify(self, request: Json, send: Send) -> None:
        served = self.models.resolve(request.get("model"))
        inputs = self._inputs(request)
        await self._prefill([p for _, p in inputs], served)
        data: list[Json] = []
        for i, (text, _) in enumerate(inputs):
            probs = class_probs(self.seed, text)
            label = CLASS_LABELS[max(range(len(probs)), key=probs.__getitem__)]
            data.append(
                {"index": i, "label": label, "probs": probs, "num_classes": len(CLASS_LABELS)}
            )
        await send_json(send, self._list_doc("classify", served.name, data, inputs))

    def _list_doc(
        self, kind: str, model: str, data: list[Json], inputs: list[tuple[str, list[int]]]
    ) -> Json:
        """vLLM's list answer of /pooling and /classify, with the prompt tokens as usage."""
        return {
            "id": f"{kind}-{self.new_id()}",
            "object": "list",
            "created": int(self.wall_clock()),
            "model": model,
            "data": data,
            "usage": _usage(sum(len(p) for _, p in inputs)),
        }

    # -- tokenizer --

    async def tokenize(self, request: Json, send: Send) -> None:
        self.models.resolve(request.get("model"))
        if "messages" in request:
            messages = request["messages"]
            if not isinstance(messages, list) or not messages:
                raise _bad("'messages' must be a non-empty list", "messages")
            add = request.get("add_generation_prompt", True)
            continuing = request.get("continue_final_message", False)
            if not isinstance(add, bool) or not isinstance(continuing, bool):
                raise _bad("add_generation_prompt and continue_final_message must be booleans")
            if add and continuing:
                raise _bad(
                    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                )
            tokens = chat_prompt(messages, add_generation_prompt=add)
            text = render_chat(messages) + (GENERATION_PROMPT if add else "")
        else:
            prompt = request.get("prompt")
            if not isinstance(prompt, str):
                raise _bad("'prompt' (a string) or 'messages' is required", "prompt")
            text, tokens = prompt, tokenize(prompt)
        strs = request.get("return_token_strs", False)
        doc = {
            "count": len(tokens),
            "max_model_len": self.models.max_model_len,
            "tokens": tokens,
            "token_strs": words(text) if strs is True else None,
        }
        await send_json(send, doc)

    async def detokenize(self, request: Json, send: Send) -> None:
        self.models.resolve(request.get("model"))
        tokens = request.get("tokens")
        if not isinstance(tokens, list) or not all(_is_token(t) for t in tokens):
            raise _bad("'tokens' must be a list of token ids", "tokens")
        for t in tokens:
            if t >= VOCAB_SIZE:
                raise _bad(f"token id {t} is out of vocabulary (size {VOCAB_SIZE})", "tokens")
        await send_json(send, {"prompt": "".join(detokenize(t) for t in tokens)})


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ids_text(ids: Sequence[int]) -> str:
    return " ".join(str(t) for t in ids)
