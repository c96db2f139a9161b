"""Build a tiny random-weight Llama that vLLM can serve on CPU, entirely offline.

    python make_tiny_model.py OUT_DIR

Run with the vLLM venv's interpreter (it needs torch, transformers and tokenizers); nothing
is downloaded. The tokenizer is a byte-level BPE trained on generated text, so any input
encodes; the chat template lets /v1/chat/completions work. The weights are random: output is
gibberish, but every code path of a real engine (load, prefill, decode, metrics) runs.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 1024
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + '\\n' + message['content'] + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)
TEXT = (
    "the a mesh node engine model token request serve gossip peer cluster slurm gpu cpu "
    "hello world fabric llama route queue cache prefix batch decode prefill answer question "
    "system user assistant say write tell me about one two three four five what why how"
)


def corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocabulary = TEXT.split()
    out = []
    for _ in range(lines):
        words = [rng.choice(vocabulary) for _ in range(rng.randint(3, 16))]
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    out.append("".join(chr(c) for c in range(32, 127)))  # every printable ASCII character
    return out


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out: Path) -> None:
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Recent transformers write the template to chat_template.jinja; older readers (and
    # people) look for it in tokenizer_config.json, so put it there as well.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR")
    out = Path(sys.argv[1])
    build(out)
    print(f"tiny llama written to {out}")


if __name__ == "__main__":
    main()
