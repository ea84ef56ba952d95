"""The demo corpus's length distribution, shared by the benchmarks.

Runtime lengths (GPT-2 tokens, EOS included, minus one) of the embedded default corpus, formatted
exactly as ``tightpack pack`` formats it (built-in chat template).
"""

from __future__ import annotations

import numpy as np

from tightpack.prepare.formats import FormatConfig, render_row
from tightpack.prepare.sources import default_corpus
from tightpack.prepare.tokenizer import load_tokenizer


def demo_runtime_lengths() -> np.ndarray:
    """Runtime length of every demo conversation, int64 ``[7168]``."""
    texts = [
        render_row(row, FormatConfig(), None, {}).text
        for chunk in default_corpus().read(0, 1024)
        for row in chunk.parsed_rows()
    ]
    backend = load_tokenizer(None).backend
    return np.array([len(encoding.ids) for encoding in backend.encode_batch(texts)], dtype=np.int64)
