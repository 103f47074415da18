"""A WikiText-103-shaped corpus, generated: the size and layout of the real one, without downloading it.

``wiki.train.tokens`` (100 M tokens by default), ``wiki.valid.tokens`` and ``wiki.test.tokens`` (WikiText-103's
217,646 and 245,569 tokens) in WikiText's layout: articles under `` = Title = `` lines, sections under
`` = = Heading = = `` lines, a blank line after every heading and every paragraph, paragraph lines of 20 to 200
tokens, every line starting and ending with a space. Words are drawn from a Zipf distribution (exponent 1) over
267,735 distinct words, ``<unk>`` among them at WikiText's rate (0.4 % of the tokens), so a training split of 100 M
tokens has every word (the rarest is expected about 28 times): its vocabulary has WikiText-103's 267,738 entries
(the 267,734 words besides ``<unk>``, the headings' ``=``, and ``<pad>``, ``<unk>``, ``<eos>``). Frequent words
are short and rare ones long, so the files are about as large as WikiText-103's (489 MB for 100 M tokens).

The same seed gives the same bytes. Everything is vectorized with numpy, a block of paragraphs at a time (about
20 s and 0.4 GB of memory for 100 M tokens on one core). Only numpy is imported.

Goal: a corpus to measure the token store on (``benchmarks/token_store.py``), shaped like the real one.

    python benchmarks/wikitext_shaped.py --out DIR [--train-tokens 100000000] [--seed 0]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

#: Distinct words of the Zipf distribution (WikiText-103's vocabulary size), ``<unk>`` included.
NUM_WORDS = 267_735
#: Tokens of WikiText-103's validation and test splits.
VALID_TOKENS, TEST_TOKENS = 217_646, 245_569
#: The Zipf rank of ``<unk>`` (0-based: about 0.4 % of the tokens, WikiText-103's rate).
UNK_RANK = 18
#: Paragraph lines hold 20 to 200 tokens.
MIN_LINE, MAX_LINE = 20, 200
_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
_PARAGRAPHS_PER_BLOCK = 20_000


def words(num_words: int = NUM_WORDS) -> list[bytes]:
    """The words by Zipf rank: distinct lower-case strings, longer as they get rarer (``<unk>`` at :data:`UNK_RANK`)."""
    ranks = np.arange(num_words)
    lengths = np.clip(np.round(1.0 + 1.1 * np.log10(ranks + 1.0)), 1, 12).astype(np.int64)
    out: list[bytes] = []
    used: dict[int, int] = {}
    for rank, length in enumerate(lengths.tolist()):
        n = used.get(length, 0)
        while 26**length <= n:  # this length is full: the next one
            length += 1
            n = used.get(length, 0)
        used[length] = n + 1
        n = n * 7_919 % 26**length  # a bijection (7,919 is prime to 26): words of one length look unalike
        digits = [(n // 26**k) % 26 for k in range(length)]
        out.append(_ALPHABET[digits].tobytes())
    out[UNK_RANK] = b"<unk>"
    return out


class _Table:
    """Items as bytes: item ``i < V`` is word ``i`` after a space, item ``V`` is ``" ="``, item ``V + 1`` ends a line
    (``" \\n"``)."""

    def __init__(self, vocabulary: list[bytes]) -> None:
        pieces = [b" " + w for w in vocabulary] + [b" =", b" \n"]
        self.equals, self.newline = len(vocabulary), len(vocabulary) + 1
        self.lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        self.bytes = np.frombuffer(b"".join(pieces), dtype=np.uint8)

    def render(self, items: np.ndarray) -> bytes:
        """The bytes of a sequence of items (vectorized: one gather)."""
        lengths = self.lengths[items]
        out_starts = np.cumsum(lengths) - lengths
        source = np.repeat(self.starts[items] - out_starts, lengths) + np.arange(int(lengths.sum()))
        return self.bytes[source].tobytes()


def _layout(rng: np.random.Generator, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per paragraph: its length, the level of the heading before it (0: none) and that heading's title words; the
    lengths add up to exactly ``tokens`` with the headings' words (``=`` included)."""
    n = int(tokens / (0.5 * (MIN_LINE + MAX_LINE))) + 16
    while True:
        lengths = rng.integers(MIN_LINE, MAX_LINE + 1, size=n)
        level = rng.choice(4, size=n, p=[0.70, 0.04, 0.20, 0.06])
        level[0] = 1  # the corpus starts with an article
        titles = np.where(level > 0, rng.integers(1, 5, size=n), 0)
        total = np.cumsum(lengths + titles + 2 * level)
        if total[-1] >= tokens:
            break
        n *= 2
    last = int(np.searchsorted(total, tokens))  # the paragraph that reaches the count
    lengths, level, titles = lengths[: last + 1].copy(), level[: last + 1].copy(), titles[: last + 1].copy()
    remaining = tokens - (int(total[last - 1]) if last else 0)
    heading = int(titles[last] + 2 * level[last])
    if remaining <= heading:  # no room for the heading and a word: the last paragraph has none
        level[last], titles[last], lengths[last] = 0, 0, remaining
    else:
        lengths[last] = remaining - heading
    return lengths, level, titles


def _items(rng: np.random.Generator, cdf: np.ndarray, table: _Table, lengths: np.ndarray, level: np.ndarray,
           titles: np.ndarray) -> np.ndarray:
    """The items of some paragraphs: per paragraph its heading line (``= .. Title .. =``) and a blank line when it
    has one, its words, and a blank line."""
    words_needed = int(lengths.sum() + titles.sum())
    drawn = np.searchsorted(cdf, rng.random(words_needed), side="right").astype(np.int64)
    # Per paragraph, when headed: [=]*level + title + [=]*level + [newline, newline]; then its words and 2 newlines.
    head = np.where(level > 0, 2 * level + titles + 2, 0)
    sizes = head + lengths + 2
    out = np.full(int(sizes.sum()), table.newline, dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    position = np.arange(out.size) - np.repeat(starts, sizes)  # position inside the paragraph's items
    par_level, par_title = np.repeat(level, sizes), np.repeat(titles, sizes)
    equals = (par_level > 0) & ((position < par_level) | (
        (position >= par_level + par_title) & (position < 2 * par_level + par_title)))
    out[equals] = table.equals
    is_title = (par_level > 0) & (position >= par_level) & (position < par_level + par_title)
    is_word = (position >= np.repeat(head, sizes)) & (position < np.repeat(head + lengths, sizes))
    takes = is_title | is_word
    out[takes] = drawn
    return out


def write_split(path: Path, tokens: int, seed: int, vocabulary: list[bytes], exponent: float = 1.0) -> int:
    """Write ``tokens`` Zipf-drawn tokens in WikiText's layout to ``path``; returns the bytes written."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(vocabulary) + 1, dtype=np.float64) ** exponent
    cdf = np.cumsum(weights / weights.sum())
    cdf[-1] = 1.0
    table = _Table(vocabulary)
    lengths, level, titles = _layout(rng, tokens)
    written = 0
    with open(path, "wb") as out:
        for start in range(0, lengths.size, _PARAGRAPHS_PER_BLOCK):
            block = slice(start, start + _PARAGRAPHS_PER_BLOCK)
            data = table.render(_items(rng, cdf, table, lengths[block], level[block], titles[block]))
            out.write(data)
            written += len(data)
    return written


def generate(out: Path, train_tokens: int = 100_000_000, seed: int = 0) -> dict[str, Path]:
    """Write ``wiki.{train,valid,test}.tokens`` into ``out`` (created); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    vocabulary = words()
    paths = {}
    for offset, (split, tokens) in enumerate((("train", train_tokens), ("valid", VALID_TOKENS),
                                              ("test", TEST_TOKENS))):
        paths[split] = out / f"wiki.{split}.tokens"
        write_split(paths[split], tokens, seed * 3 + offset, vocabulary)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory to write the three files into")
    parser.add_argument("--train-tokens", type=int, default=100_000_000, help="tokens of wiki.train.tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    paths = generate(args.out, args.train_tokens, args.seed)
    for split, path in paths.items():
        print(f"{path}: {path.stat().st_size / 1e6:,.1f} MB")
    print(f"generated in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
