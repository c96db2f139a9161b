"""Workloads for bench/routing.py: closed-loop client programs as pure, seeded request recipes.

A workload never does I/O. ``first(client, n)`` is the first call of client ``client``'s ``n``-th
program (a tree of thoughts, a conversation); ``follow(call, output)`` is what comes after the
call answered ``output``: two children for a tree node (sent concurrently), the next turn of a
conversation (sent at once: no think time), nothing when the program is over. Every length and
every word comes from a seeded RNG keyed by (seed, client, program, position), and the simulated
engines answer a prompt deterministically, so every policy runs the very same programs; only how
many of them fit in the measured window differs.

Prompts are made of pseudo-words without punctuation: the simulated engine's tokenizer counts
one token per word, so "words" below are tokens (chat rendering adds a few role tokens).

* ``tot`` (SkyLB §5, Tree of Thoughts): a root = a system prompt shared by every tree + a
  problem; branching factor 2, depth 4 (15 requests per tree); a child's messages are its
  parent's messages + the parent's answer + a short "explore option k" turn, so siblings share
  the parent's whole prompt and answer. A quarter of the trees (every 4th tree of each client)
  use one of a few popular problems, so some roots are shared across clients; the others use a
  problem of their own.
* ``chat``: conversations of ``turns`` turns; the first user turn carries a document, each next
  turn appends the previous answer and a short user message. ``X-Session-ID`` names the
  conversation (``chat-nosid``: same programs without it, prefix matching only).
* ``nosharing``: the ``tot`` tree shape and concurrency (1, 2, 4, 8 requests in flight per
  client), but every prompt is fresh random text as long as the ``tot`` prompt at that depth:
  nothing to share, so a cache-aware policy should do as well as least-load and no better.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

Message = dict[str, str]


@dataclass(frozen=True)
class Shape:
    """Sizes in words (~ tokens); ``output`` bounds ``max_tokens`` (the engine writes exactly
    that many, so answer lengths vary from request to request as they do in real serving)."""

    system_words: int = 300
    problem_words: tuple[int, int] = (900, 1300)
    output_tokens: tuple[int, int] = (16, 96)
    depth: int = 4
    branches: int = 2
    shared_problems: int = 6
    shared_every: int = 4  # every n-th tree of a client uses a popular (shared) problem
    document_words: tuple[int, int] = (700, 1100)
    user_words: tuple[int, int] = (30, 90)
    turns: int = 6


@dataclass(frozen=True)
class Call:
    """One request of a program: what to send and where it sits in the program."""

    messages: tuple[Message, ...]
    max_tokens: int
    session: str | None
    client: int
    program: int
    path: tuple[int, ...] = ()  # tree: child indices from the root; chat: (turn,)
    meta: dict[str, int] = field(default_factory=dict, compare=False)


_ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def _vocabulary(seed: int, size: int = 4096) -> list[str]:
    rng = random.Random(f"vocab-{seed}")
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(_ALPHABET) for _ in range(rng.randint(3, 9))))
    return sorted(words)


class Workload:
    name = "base"
    family = ""  # seeds the RNG: workloads of one family send the same programs

    def __init__(self, seed: int = 0, shape: Shape | None = None) -> None:
        self.seed = seed
        self.shape = shape or Shape()
        self.vocab = _vocabulary(seed)

    def rng(self, *key: object) -> random.Random:
        family = self.family or self.name
        return random.Random(f"{family}|{self.seed}|" + "|".join(map(str, key)))

    def words(self, n: int, *key: object) -> str:
        rng = self.rng("words", *key)
        vocab = self.vocab
        return " ".join(vocab[rng.randrange(len(vocab))] for _ in range(n))

    def max_tokens(self, *key: object) -> int:
        lo, hi = self.shape.output_tokens
        return self.rng("out", *key).randint(lo, hi)

    def first(self, client: int, program: int) -> Call:
        raise NotImplementedError

    def follow(self, call: Call, output: str) -> list[Call]:
        raise NotImplementedError


class TreeOfThoughts(Workload):
    name = "tot"

    def system(self) -> str:
        return "You are a careful math tutor. " + self.words(self.shape.system_words, "system")

    def problem_id(self, client: int, program: int) -> str:
        shape = self.shape
        if shape.shared_every and program % shape.shared_every == shape.shared_every - 1:
            # A popular problem, shared across clients (SkyLB: trees sharing roots).
            popular = self.rng("popular", client, program).randrange(shape.shared_problems)
            return f"popular-{popular}"
        return f"own-{client}-{program}"

    def first(self, client: int, program: int) -> Call:
        pid = self.problem_id(client, program)
        lo, hi = self.shape.problem_words
        n = self.rng("problem-len", pid).randint(lo, hi)
        messages = (
            {"role": "system", "content": self.system()},
            {"role": "user", "content": f"Problem {pid}: " + self.words(n, "problem", pid)},
        )
        return Call(messages, self.max_tokens(client, program, ()), None, client, program)

    def follow(self, call: Call, output: str) -> list[Call]:
        shape = self.shape
        if len(call.path) + 1 >= shape.depth:
            return []
        out = []
        for k in range(shape.branches):
            path = (*call.path, k)
            messages = (
                *call.messages,
                {"role": "assistant", "content": output},
                {"role": "user", "content": f"Step {len(path)}: explore option {k} further."},
            )
            out.append(
                Call(
                    messages,
                    self.max_tokens(call.client, call.program, path),
                    None,
                    call.client,
                    call.program,
                    path,
                )
            )
        return out


class NoSharing(TreeOfThoughts):
    """The tree shape of ``tot``, every prompt unique: the prompt of a node is fresh text as
    long as the ``tot`` prompt would be at that depth (root length + depth x an answer)."""

    name = "nosharing"

    def _unique(self, call_key: tuple[object, ...], n: int) -> tuple[Message, ...]:
        nonce = "-".join(map(str, call_key))
        return ({"role": "user", "content": f"Request {nonce}: " + self.words(n, *call_key)},)

    def first(self, client: int, program: int) -> Call:
        lo, hi = self.shape.problem_words
        n = self.shape.system_words + self.rng("len", client, program).randint(lo, hi)
        messages = self._unique((client, program, ()), n)
        return Call(
            messages, self.max_tokens(client, program, ()), None, client, program, (), {"n": n}
        )

    def follow(self, call: Call, output: str) -> list[Call]:
        shape = self.shape
        if len(call.path) + 1 >= shape.depth:
            return []
        n = call.meta["n"] + call.max_tokens + 8
        out = []
        for k in range(shape.branches):
            path = (*call.path, k)
            out.append(
                Call(
                    self._unique((call.client, call.program, path), n),
                    self.max_tokens(call.client, call.program, path),
                    None,
                    call.client,
                    call.program,
                    path,
                    {"n": n},
                )
            )
        return out


class Chat(Workload):
    name = "chat"
    with_session = True

    def first(self, client: int, program: int) -> Call:
        shape = self.shape
        lo, hi = shape.document_words
        doc = self.words(self.rng("doc-len", client, program).randint(lo, hi), client, program)
        messages = (
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Conversation {client}-{program}. Read this: {doc}"},
        )
        return self._call(messages, client, program, 0)

    def _call(self, messages: tuple[Message, ...], client: int, program: int, turn: int) -> Call:
        session = f"conv-{self.seed}-{client}-{program}" if self.with_session else None
        return Call(
            messages,
            self.max_tokens(client, program, turn),
            session,
            client,
            program,
            (turn,),
        )

    def follow(self, call: Call, output: str) -> list[Call]:
        turn = call.path[0] + 1
        if turn >= self.shape.turns:
            return []
        lo, hi = self.shape.user_words
        n = self.rng("user-len", call.client, call.program, turn).randint(lo, hi)
        messages = (
            *call.messages,
            {"role": "assistant", "content": output},
            {"role": "user", "content": self.words(n, call.client, call.program, turn)},
        )
        return [self._call(messages, call.client, call.program, turn)]


class ChatNoSession(Chat):
    name = "chat-nosid"
    family = "chat"
    with_session = False


WORKLOADS: dict[str, type[Workload]] = {
    w.name: w for w in (TreeOfThoughts, Chat, ChatNoSession, NoSharing)
}


# The trace the shared-prompts workload takes its turn lengths from; printed by every bench that
# uses it, as its owners ask.
TRACE_ATTRIBUTION = (
    "Turn lengths: Azure LLM inference trace 2023 (conversation), Azure/AzurePublicDataset, "
    'CC-BY 4.0; Patel et al., "Splitwise: Efficient generative LLM inference using phase '
    'splitting", ISCA 2024.'
)


def read_trace_lengths(path: str, limit: int = 0) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per line of an Azure LLM trace CSV
    (``TIMESTAMP,ContextTokens,GeneratedTokens``), in file order; ``limit`` lines at most."""
    out: list[tuple[int, int]] = []
    with open(path, encoding="utf-8") as f:
        next(f, None)  # header
        for line in f:
            parts = line.rstrip("\n").split(",")
            if len(parts) != 3:
                continue
            out.append((int(parts[1]), int(parts[2])))
            if limit and len(out) >= limit:
                break
    return out


class SharedPrompts(Workload):
    """Multi-turn conversations over a few long shared system prompts, turn lengths from a real
    trace: the shape a new user's chat product sends (a handful of long system prompts, one per
    assistant or tool, under many short conversations), and the one on which a routing
    regression went unseen by ``tot``/``chat``.

    Each conversation picks one of ``shared_prompts`` system prompts (``system_prompt_words``
    each, shared by every client) and a run of consecutive lines of the trace, one per turn:
    turn k's new user message is that line's prompt length / ``trace_scale`` words and its
    answer that line's output length / ``trace_scale`` tokens (clamped), so turns vary as the
    trace does while a cell still sees thousands of requests. No ``X-Session-ID``: what keeps a
    conversation on the node holding its prefix is the router's prefix matching alone, as for a
    client that sends plain OpenAI requests.
    """

    name = "shared-prompts"
    lengths: list[tuple[int, int]] = []  # set by the bench from the trace (see load_trace)

    shared_prompts = 4
    system_prompt_words = 2000
    turns = (3, 8)
    trace_scale = 4
    user_words = (16, 600)
    output_tokens = (4, 32)

    @classmethod
    def load_trace(cls, path: str) -> None:
        cls.lengths = read_trace_lengths(path)

    def system(self, index: int) -> str:
        head = f"You are assistant number {index}. Follow these instructions. "
        return head + self.words(self.system_prompt_words, "system", index)

    def _turn_lengths(self, line: int) -> tuple[int, int]:
        if not self.lengths:
            raise RuntimeError("SharedPrompts.load_trace(path) was not called")
        prompt, output = self.lengths[line % len(self.lengths)]
        lo, hi = self.user_words
        olo, ohi = self.output_tokens
        scale = self.trace_scale
        return min(hi, max(lo, prompt // scale)), min(ohi, max(olo, output // scale))

    def first(self, client: int, program: int) -> Call:
        rng = self.rng("conversation", client, program)
        prompt = rng.randrange(self.shared_prompts)
        line = rng.randrange(max(1, len(self.lengths)))
        turns = rng.randint(*self.turns)
        meta = {"line": line, "turns": turns}
        words, out = self._turn_lengths(line)
        messages = (
            {"role": "system", "content": self.system(prompt)},
            {"role": "user", "content": self.words(words, client, program, 0)},
        )
        return Call(messages, out, None, client, program, (0,), meta)

    def follow(self, call: Call, output: str) -> list[Call]:
        turn = call.path[0] + 1
        if turn >= call.meta["turns"]:
            return []
        words, out = self._turn_lengths(call.meta["line"] + turn)
        messages = (
            *call.messages,
            {"role": "assistant", "content": output},
            {"role": "user", "content": self.words(words, call.client, call.program, turn)},
        )
        return [Call(messages, out, None, call.client, call.program, (turn,), call.meta)]


WORKLOADS[SharedPrompts.name] = SharedPrompts
