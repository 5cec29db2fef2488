"""A seeded tiny random-weight Llama target with a real (ChatML) chat template: the test suite's target.

The tokenizer is a byte-level BPE trained in code on a small generated corpus, so token boundaries are
as irregular as a real tokenizer's, and it carries the special tokens of several chat-template families
(ChatML, Llama-3, Mistral, Qwen3 thinking tags) so tests can attach those templates to it offline.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",  # ChatML / SmolLM2 / Qwen
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",  # Llama-3
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",  # Mistral
    "<think>",
    "</think>",  # Qwen3
]

_WORDS = (
    "the a an of to in is it that for on with as was at by be this from or have not are but what all were "
    "when we there can your which their said if do will each about how up out them then she many some so "
    "these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just "
    "where most know get through back much before go good new write our used me man too any day same right "
    "look think also around another came come work three word must because does part even place well such "
    "code function return value list sum number answer question explain why because python def print "
    "math equation solve step total result story poem ocean travel email report data plan idea"
).split()


def _corpus(seed: int, n: int = 3000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 999)))
        line = " ".join(words)
        line = line[0].upper() + line[1:] + rng.choice([".", "?", "!", ":", ","])
        if rng.random() < 0.2:
            line = "    " + line.replace(" ", "_", 2) + "()\n"
        lines.append(line)
    return lines


def tiny_tokenizer(seed: int = 0, vocab_size: int = 384, chat_template: str = CHATML_TEMPLATE):
    """A byte-level BPE tokenizer (trained here, deterministic) wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(seed), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )


def tiny_llama(tokenizer, seed: int = 0, num_layers: int = 2, hidden_size: int = 64, dtype=torch.float32):
    """A random-weight LlamaForCausalLM sized for unit tests (GQA: 4 query heads, 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        # a wider init than the default 0.02 gives peaked next-token distributions, like a trained model's
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def save_tiny_target(out_dir: str | Path, seed: int = 0, num_layers: int = 2, hidden_size: int = 64) -> Path:
    """Write a tiny target as a local HF directory (model + tokenizer), usable as `model.target`."""
    out = Path(out_dir)
    tok = tiny_tokenizer(seed)
    model = tiny_llama(tok, seed=seed, num_layers=num_layers, hidden_size=hidden_size)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def write_two_domain_chats(path: Path, n: int = 8) -> Path:
    """n one-turn chats as a JSONL data source, alternately in the domains "math" and "code" (`domain_field:
    category`), questions of one to three repeats and a repeated answer: eval's and the benches' tiny data."""
    import json

    rows = [
        {
            "id": f"q{i}",
            "category": ["math", "code"][i % 2],
            "messages": [
                {"role": "user", "content": f"Question {i}: what is {i} plus one? " * (1 + i % 3)},
                {"role": "assistant", "content": f"The answer is {i + 1}. The answer is {i + 1}."},
            ],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
