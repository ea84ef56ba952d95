"""Long multilingual chat rows: real conversations (the demo corpus) joined into long user turns.

Shared by tests/test_collate_truncation.py and benchmarks/bench_collate_truncation.py. Each row has a
system message, one to three rounds (by default), user turns of 1 to 8 joined conversations (heavy-tailed:
many rows are over 4,096 GPT-2 tokens, most of their tokens prompt) with French, Japanese and
Russian text, and short assistant answers.
"""

from __future__ import annotations

import numpy as np

from tightpack.prepare.sources import default_corpus

_TAILS = (" — résumé en français, s'il vous plaît.", " 日本語で答えてください。", " Ответьте по-русски.")


def long_chat_rows(count: int, seed: int = 0, max_rounds: int = 3) -> list[dict]:
    """``count`` chat rows (``{"messages": [...]}``) of 1 to ``max_rounds`` rounds, the same for the
    same ``seed``."""
    conversations = [
        "\n".join(message["content"] for message in row["messages"])
        for chunk in default_corpus().read(0, 1024)
        for row in chunk.parsed_rows()
    ]
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        messages = [{"role": "system", "content": "You are a helpful multilingual assistant."}]
        for _round in range(int(rng.integers(1, max_rounds + 1))):
            picked = rng.choice(len(conversations), size=int(rng.integers(1, 9)), replace=False)
            user = "\n\n".join(conversations[j] for j in picked) + _TAILS[int(rng.integers(len(_TAILS)))]
            answer = conversations[int(rng.integers(len(conversations)))][:400] or "ok"
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages})
    return rows
