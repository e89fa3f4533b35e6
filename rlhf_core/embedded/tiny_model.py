"""Build the embedded default model: a tiny Hugging Face causal LM and a locally trained tokenizer.

Nothing is downloaded. The tokenizer is a byte-level BPE trained on the task's own text
(digits split one per token, so arithmetic is learnable); the model is a real Qwen2 or Llama
architecture built from a config and saved with ``save_pretrained``. The result is an
ordinary HF model directory, loaded through exactly the same code path as a user's model.

Run: ``alignflow init-model`` (reads ``params.yaml``'s ``model`` section).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

SPECIAL_TOKENS = ("<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _train_tokenizer_in_process(corpus: Path, out_dir: Path, vocab_size: int) -> None:
    """Train and save a byte-level BPE tokenizer (runs inside the subprocess only)."""
    from tokenizers import (  # lazy: tokenizers (tokenizer subprocess only)
        Tokenizer, decoders, models, pre_tokenizers, trainers)
    from transformers import PreTrainedTokenizerFast  # lazy: transformers (light `alignflow validate`)

    tok = Tokenizer(models.BPE())
    # Digits one per token, then byte-level so any UTF-8 text round-trips exactly.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.model_max_length = 2048
    fast.save_pretrained(str(out_dir))


def train_tokenizer(texts: Iterable[str], out_dir: Path, vocab_size: int = 320) -> Path:
    """Train the tokenizer in a subprocess and save it to ``out_dir``.

    A subprocess because training with ``tokenizers`` in-process was seen to slow later
    torch CPU work about 6x (its Rust thread pool stays alive).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(texts) + "\n", encoding="utf-8")
        subprocess.run(
            [sys.executable, "-m", "rlhf_core.embedded.tiny_model", "--corpus", str(corpus),
             "--out", str(out_dir), "--vocab-size", str(vocab_size)],
            check=True,
        )
    return out_dir


def build_tiny_model(
    tokenizer_dir: Path,
    out_dir: Path,
    *,
    arch: str = "qwen2",
    hidden_size: int = 192,
    num_layers: int = 6,
    num_heads: int = 6,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_positions: int = 128,
    seed: int = 0,
    chat_template: str | None = None,
    added_tokens: Sequence[str] = (),
) -> Path:
    """Build a randomly initialised causal LM from a config and save model + tokenizer.

    ``arch`` is ``"qwen2"`` or ``"llama"``: both are stock ``transformers`` classes, so the
    saved directory is indistinguishable in shape from a hub checkpoint. ``added_tokens`` become
    single tokens of the saved tokenizer (and rows of the embedding).
    """
    import torch  # lazy: torch (light `alignflow validate`)
    from transformers import (  # lazy: transformers (light `alignflow validate`)
        AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if added_tokens:  # e.g. a tool call's tags: one token each, kept by decode (not special)
        tokenizer.add_tokens(list(added_tokens))
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    if arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        raise ValueError(f"model.arch must be 'qwen2' or 'llama', got {arch!r}")
    torch.manual_seed(seed)
    model = cls(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def count_parameters(model_dir: Path) -> int:
    """Parameter count read from the saved safetensors (no model instantiation)."""
    from safetensors import safe_open  # lazy: safetensors (light `alignflow validate`)

    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                total += _prod(fh.get_slice(key).get_shape())
    return total


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the embedded byte-level BPE tokenizer.")
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, default=320)
    args = parser.parse_args(argv)
    _train_tokenizer_in_process(args.corpus, args.out, args.vocab_size)
    print(json.dumps({"tokenizer": str(args.out)}))


if __name__ == "__main__":
    _main()
