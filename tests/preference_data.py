"""Preference, KTO and group rows built from the demo corpus, in TRL's conventions, for the tests and
benchmarks of preference packing: a conversation's first assistant reply is ``chosen``, the first
reply of another conversation ``rejected`` (a plausible assistant turn that does not answer)."""

from __future__ import annotations

from tightpack.prepare.sources import default_corpus


def conversations(count: int, *, start: int = 0) -> list[list[dict]]:
    """``count`` demo conversations that open with a user turn answered by the assistant."""
    found = []
    for chunk in default_corpus().read(0, 4 * (start + count) + 64):
        for row in chunk.parsed_rows():
            messages = row["messages"]
            if len(messages) >= 2 and messages[0]["role"] == "user" and messages[1]["role"] == "assistant":
                found.append(messages)
    if len(found) < start + count:
        raise ValueError(f"the demo corpus has {len(found)} such conversations, asked for {start + count}")
    return found[start : start + count]


def conversation_pairs(count: int) -> list[dict]:
    """``prompt`` (the opening user turn) / ``chosen`` / ``rejected`` (one assistant message each)."""
    talks = conversations(count + 8)

    def other_reply(i: int) -> dict:  # the next conversation's reply that is not this one's
        return next(talk[1] for talk in talks[i + 1 :] if talk[1]["content"] != talks[i][1]["content"])

    return [
        {"prompt": [talk[0]], "chosen": [talk[1]], "rejected": [other_reply(i)]}
        for i, talk in enumerate(talks[:count])
    ]


def text_pairs(count: int) -> list[dict]:
    """The same pairs as text: ``prompt`` ends with ``"\\nAnswer:"``, the branches start with a space."""
    return [
        {
            "prompt": row["prompt"][0]["content"] + "\nAnswer:",
            "chosen": " " + row["chosen"][0]["content"],
            "rejected": " " + row["rejected"][0]["content"],
        }
        for row in conversation_pairs(count)
    ]


def groups(count: int, size: int) -> list[dict]:
    """``prompt`` / ``completions`` (``size`` replies, its own first) / ``rewards`` (1 for its own)."""
    talks = conversations(count + size)
    return [
        {
            "prompt": [talk[0]],
            "completions": [[talk[1]]] + [[talks[i + k][1]] for k in range(1, size)],
            "rewards": [1.0] + [0.0] * (size - 1),
        }
        for i, talk in enumerate(talks[:count])
    ]
