"""The tiny pipelines' CLIP-style byte-level BPE vocabulary, and the tokenizer built from it."""

from __future__ import annotations

from typing import Any

# Words the tiny tokenizer knows as single tokens: the training templates, the recipe's prompts and
# initializer ("toy"), and a few common words for tests.
WORDS = """
toy a an the of photo rendering cropped clean dark bright good close-up rendition nice small weird large cool
painting picture in style by artwork yellow robot at beach high quality dog cat red blue green on with and , .
drawing image object thing
""".split()  # noqa: SIM905 - a word list, not one word a line

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-to-printable-character table of GPT-2/CLIP byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def build_clip_vocab(words: list[str], vocab_size: int | None = None) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A CLIP-style byte-level BPE vocabulary in which every word of ``words`` is one token.

    ``toy`` gets the first merges, so it is always a single token whatever else is in the vocabulary.
    With ``vocab_size`` the vocabulary is padded with unreachable filler tokens up to that size (the real
    CLIP vocabulary has 49,408 entries; what matters for a benchmark is the size of the embedding matrix).
    """
    chars = list(_bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars]
    merges: list[tuple[str, str]] = []
    seen = set(tokens)
    ordered = ["toy"] + [w for w in words if w != "toy"]
    for word in ordered:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        current = pieces[0]
        for piece in pieces[1:]:
            merged = current + piece
            if merged not in seen:
                merges.append((current, piece))
                tokens.append(merged)
                seen.add(merged)
            current = merged
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if vocab_size is not None:
        filler = 0
        while len(vocab) < vocab_size - 2:
            vocab[f"<|filler{filler}|></w>"] = len(vocab)
            filler += 1
    vocab[BOS] = len(vocab)
    vocab[EOS] = len(vocab)
    return vocab, merges


def clip_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Any:
    """A CLIP tokenizer of ``vocab`` and ``merges``."""
    from transformers import CLIPTokenizer

    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77, pad_token=EOS)
