"""Record what a real vLLM publishes on its KV-events socket, as raw ZMQ frames, for the
decoder's tests (tests/unit/kvevents: recorded batches of both encodings).

    VENV/bin/python record_kv_events.py MODEL_DIR OUT.msgpack

Run with the vLLM venv's interpreter (it has vLLM, pyzmq and msgspec). It runs vLLM's engine on
the tiny model in this process (``vllm.LLM``: vLLM's own scheduler, block pool and ZMQ
publisher) with prefix caching and KV events on localhost, subscribes, sends prompts that share
a long prefix and then enough others to evict it, and writes every multipart message it
received as ``[[topic, seq, payload], ...]`` (msgpack). vLLM of this venv publishes events as
tagged maps; it also writes the same batches re-encoded with the positional (array-like)
structs vLLM used before mid-2026 (``OUT.array.msgpack``), with vLLM's own msgspec encoder.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

import msgspec
import zmq


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# vLLM before mid-2026: the same events as positional arrays (array_like=True, tag=True)
class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(OldEvent):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(OldEvent):
    block_hashes: list[Any]
    medium: str | None


class AllBlocksCleared(OldEvent):
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def as_array_like(payload: bytes) -> bytes:
    ts, events, *rest = msgspec.msgpack.decode(payload)
    old: list[Any] = []
    for e in events:
        kind = e["type"]
        if kind == "BlockStored":
            old.append(
                BlockStored(
                    e["block_hashes"],
                    e["parent_block_hash"],
                    e["token_ids"],
                    e["block_size"],
                    e.get("lora_id"),
                    e.get("medium"),
                )
            )
        elif kind == "BlockRemoved":
            old.append(BlockRemoved(e["block_hashes"], e.get("medium")))
        else:
            old.append(AllBlocksCleared())
    return msgspec.msgpack.encode(OldBatch(ts, old, rest[0] if rest else None))


def main() -> int:
    model, out = sys.argv[1], sys.argv[2]
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                       "VLLM_NO_USAGE_STATS": "1"})  # fmt: skip
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    # An endpoint without "*" is one vLLM's publisher connects to (``_is_bind_endpoint``): the
    # subscriber binds it, on localhost only.
    sub.bind(f"tcp://127.0.0.1:{port}")
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://127.0.0.1:{port}",
        topic="kv-events",
    )
    # The engine in this process (the scheduler, its block pool and its publisher are vLLM's
    # own), a cache of 20 blocks of 32 tokens (the CPU backend's block size is a multiple of
    # 32) so that a few prompts evict the first ones.
    llm = LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True,
              enable_prefix_caching=True, block_size=32, num_gpu_blocks_override=20,
              kv_events_config=config)  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0.0)
    frames: list[list[bytes]] = []

    def drain() -> None:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            if sub.poll(100):
                frames.append(sub.recv_multipart())

    llm.generate(["warm up: the publisher connects before this is answered"], params)
    drain()
    frames.clear()  # batches from before the subscription may be missing: start after them
    shared = "system: answer briefly and cite your sources. " * 6
    for i in range(2):
        llm.generate([shared + f"question {i}"], params)
        drain()
    for i in range(8):  # other prompts: the shared prefix's blocks are evicted
        llm.generate([f"{i} other words " * 30], params)
        drain()
    sub.close(0)
    with open(out, "wb") as f:
        f.write(msgspec.msgpack.encode(frames))
    with open(out.replace(".msgpack", ".array.msgpack"), "wb") as f:
        f.write(msgspec.msgpack.encode([[t, s, as_array_like(p)] for t, s, p in frames]))
    print(f"{len(frames)} batches recorded")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
