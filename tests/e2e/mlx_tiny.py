"""A tiny MLX model folder for the mlx runtime's tests: random weights, a small tokenizer.

The model is a two-layer llama (hidden size 64) with random weights saved by
mlx; the tokenizer is a byte-level BPE trained in a moment on a few lines with
the ``tokenizers`` package (which mlx-lm pulls in through transformers), saved
as ``tokenizer.json`` and ``tokenizer_config.json`` with a ChatML template.

The output head's rows for the control tokens are zero and the others are
large, so the control tokens (EOS among them) are never among the likely
tokens: a generation of this model runs to ``max_tokens`` unless a stop id
ends it.

With ``sliding_window`` the first layer attends over that many tokens only
(mlx-lm gives it a ``RotatingKVCache``, which cannot be trimmed once it has
wrapped): the model the prompt cache's fallback is tested on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TEXT = "<|im_end|>"
VOCAB_SIZE = 320

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! This is a tiny tokenizer for a tiny model.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a short poem about the sea, the moon and the rain.",
    "user assistant system: the model answers the question.",
] * 4


def mlx_import_error() -> str | None:
    """Why mlx cannot run here (the reason a test skips with), or None."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mlx does not import here: {exc}"
    return None


def chat(user: str) -> str:
    """One user turn and the assistant's header, in the tiny model's ChatML."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _tokenizer(folder: Path) -> int:
    """Train and save the tokenizer; returns the vocabulary size it ended with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TEXT,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 512,
        "chat_template": CHATML,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return int(tok.get_vocab_size())


def build_tiny_model(folder: Path, *, seed: int = 0, sliding_window: int = 0) -> Path:
    """Write config.json, model.safetensors and the tokenizer into ``folder``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    folder.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(folder)
    eos_id = SPECIALS.index(EOS_TEXT)
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    if sliding_window:
        config["layer_types"] = ["sliding_attention", "full_attention"]
        config["sliding_window"] = sliding_window
    mx.random.seed(seed)
    args: Any = llama.ModelArgs  # from_dict keeps the keys the class knows
    model = llama.Model(args.from_dict(config))
    head = mx.random.normal((vocab, 64), key=mx.random.key(seed + 1))
    # control tokens score 0 while the hidden state (RMS 1) makes the others
    # spread with a deviation of 8: they never come out
    head[: len(SPECIALS)] = 0.0
    model.lm_head.weight = head
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
