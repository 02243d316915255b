"""Sentence embeddings for partitioning data without labels: MiniLM-L6, mean-pooled over tokens, cached.

The embeddings of a list of texts are computed once and kept under the user's cache directory
(``$XDG_CACHE_HOME/fedlowrank/embeddings`` or ``~/.cache/fedlowrank/embeddings``), keyed by a hash of the model,
the truncation length and the texts, so that every run on the same data reuses them.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from .bundled import cache_dir, minilm_path

MODEL = "minilm"


def texts_key(texts: list[str], max_length: int) -> str:
    """A hex digest of the model name, ``max_length`` and every text (order matters)."""
    h = hashlib.sha256(f"{MODEL}|{max_length}|{len(texts)}".encode())
    for t in texts:
        h.update(b"\0" + t.encode("utf-8"))
    return h.hexdigest()[:32]


@torch.no_grad()
def embed(texts: list[str], max_length: int = 128, batch_size: int = 64) -> np.ndarray:
    """``[N, 384]`` float32 MiniLM embeddings: the last hidden state averaged over each text's tokens
    (padding excluded), L2-normalised. Computed here, without the cache."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path())
    net = AutoModel.from_pretrained(minilm_path()).eval()
    out = []
    for start in range(0, len(texts), batch_size):
        enc = tok(texts[start:start + batch_size], truncation=True, max_length=max_length, padding=True,
                  return_tensors="pt")
        hidden = net(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out).numpy().astype(np.float32)


def sentence_embeddings(texts: list[str], max_length: int = 128) -> np.ndarray:
    """:func:`embed` of ``texts``, from the cache when it holds them (written atomically otherwise)."""
    path = cache_dir() / "embeddings" / f"{texts_key(texts, max_length)}.npy"
    if path.exists():
        cached = np.load(path)
        if cached.shape[0] == len(texts):
            return cached
    vectors = embed(texts, max_length)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with tmp.open("wb") as fh:
        np.save(fh, vectors)
    os.replace(tmp, path)
    return vectors
