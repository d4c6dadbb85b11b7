"""Hypothesis strategies that bend valid inputs into malformed ones: bytes with bytes flipped or
cut, texts with characters changed, YAML with lines moved. Most results are malformed in some
way, and some stay valid, which is what fuzzing a parser needs."""

from __future__ import annotations

from hypothesis import strategies as st

# Syntax of YAML and of label selectors, a few letters, and characters readers choke on.
SYNTAX_CHARS = [*":-[]{}()&*!|>'\"%@`#,=?~/ \t\n", *"0123456789abcxyz", "é", "\x1f", "\ufeff"]


@st.composite
def mutated_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` with bytes flipped, cut short, or random bytes inserted.

    The choices drawn do not depend on `data`'s length: the fuzz tests mutate requests built
    from a live broker's routes and revisions, which may change between two examples, and
    hypothesis replays an example's choices expecting the same draws (else FlakyStrategyDefinition).
    """
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.one_of(st.integers(0, 3), st.integers(0, 1 << 16))) % (len(out) + 1)
        how = draw(st.sampled_from(["flip", "cut", "insert"]))
        if how == "flip" and at < len(out):
            out[at] ^= draw(st.integers(1, 255))
        elif how == "cut":
            del out[at:]
        else:
            out[at:at] = draw(st.binary(min_size=1, max_size=4))
    return bytes(out)


@st.composite
def mutated_text(draw: st.DrawFn, texts: st.SearchStrategy[str]) -> str:
    """A text of `texts` with characters replaced, inserted or deleted here and there."""
    text = draw(texts)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 4))
        inserted = draw(
            st.one_of(st.text(st.sampled_from(SYNTAX_CHARS), max_size=4), st.text(max_size=3))
        )
        text = text[:at] + inserted + text[at + cut :]
    return text


@st.composite
def mutated_yaml(draw: st.DrawFn, valid: str) -> str:
    """`valid` YAML with lines deleted, repeated, swapped or inserted, characters changed, or
    cut short: malformed documents of every kind, and some that are still valid."""
    lines = valid.splitlines(keepends=True)
    for _ in range(draw(st.integers(1, 3))):
        lines = lines or [""]
        at = draw(st.integers(0, len(lines) - 1))
        how = draw(st.sampled_from(["delete", "repeat", "swap", "insert", "change", "cut"]))
        if how == "delete":
            del lines[at]
        elif how == "repeat":
            lines.insert(at, lines[at])
        elif how == "swap":
            other = draw(st.integers(0, len(lines) - 1))
            lines[at], lines[other] = lines[other], lines[at]
        elif how == "insert":
            lines.insert(at, draw(mutated_text(st.sampled_from(lines))))
        elif how == "change":
            lines[at] = draw(mutated_text(st.just(lines[at])))
        else:
            text = "".join(lines)
            lines = [text[: draw(st.integers(0, len(text)))]]
    return "".join(lines)
