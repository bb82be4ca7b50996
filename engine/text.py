"""Real English text that ships with every Python install: the documentation topics of
``pydoc_data.topics`` (~465k characters, the text behind ``help('topics')``).

The topics repeat each other heavily (the "compound" topic contains every statement's topic,
"specialnames" most of "datamodel"...), so the splits are made of *unique paragraphs*: walking
the topics in sorted-key order, a paragraph (text between blank lines) is kept where it first
occurs and dropped everywhere else. Then

    heldout_text()       paragraphs first seen in topic i with i % 5 == HELDOUT_SLOT  (~64k chars)
    calibration_text()   every other unique paragraph                                  (~305k chars)

so no paragraph of the held-out split occurs in the calibration split. Both are deterministic
for a given Python version (the topics change between releases, so :func:`text_info` records
the version and a digest of the text). Perplexity, KL and routing traces use the held-out
split; anything fitted (moefy's clustering and routers) uses the calibration split only.
"""

from __future__ import annotations

import functools
import hashlib
import sys

from engine.errors import ConfigError

HELDOUT_EVERY = 5  # topic i (sorted-key order) is held out when i % HELDOUT_EVERY == HELDOUT_SLOT
HELDOUT_SLOT = 0
_SEP = "\n\n"


@functools.lru_cache(maxsize=1)
def _splits() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """split -> (topic keys, unique paragraphs in order)."""
    from pydoc_data.topics import topics

    seen: set[str] = set()
    out: dict[str, tuple[list[str], list[str]]] = {"calibration": ([], []), "heldout": ([], [])}
    for i, (key, body) in enumerate(sorted(topics.items())):
        split = "heldout" if i % HELDOUT_EVERY == HELDOUT_SLOT else "calibration"
        out[split][0].append(key)
        for para in body.split(_SEP):
            norm = para.strip()
            if norm and norm not in seen:
                seen.add(norm)
                out[split][1].append(para.strip("\n"))
    return {k: (tuple(keys), tuple(paras)) for k, (keys, paras) in out.items()}


def calibration_text() -> str:
    """Unique paragraphs of the calibration topics, joined in order."""
    return _SEP.join(_splits()["calibration"][1])


def heldout_text() -> str:
    """Unique paragraphs first seen in the held-out topics; shares no paragraph with
    :func:`calibration_text`."""
    return _SEP.join(_splits()["heldout"][1])


def paragraphs(split: str) -> tuple[str, ...]:
    """The paragraphs of ``split`` ("calibration" or "heldout")."""
    _check(split)
    return _splits()[split][1]


def split_topics(split: str) -> list[str]:
    """Topic keys of ``split`` ("calibration" or "heldout")."""
    _check(split)
    return list(_splits()[split][0])


def _check(split: str) -> None:
    if split not in ("calibration", "heldout"):
        raise ConfigError(f"text split must be 'calibration' or 'heldout', got {split!r}")


def text_info(split: str) -> dict:
    """Provenance of a split: source, python version, topic count, characters, sha256."""
    _check(split)
    text = calibration_text() if split == "calibration" else heldout_text()
    return {
        "source": "pydoc_data.topics.topics",
        "split": split,
        "selection": f"unique paragraphs; topics i % {HELDOUT_EVERY} == {HELDOUT_SLOT} held out",
        "python": ".".join(map(str, sys.version_info[:3])),
        "topics": len(split_topics(split)),
        "characters": len(text),
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }


def windows(tokenizer, text: str, window: int, count: int | None = None, *,
            spread: bool = True, strict: bool = True) -> list[list[int]]:
    """Non-overlapping token windows of exactly ``window`` ids cut from ``text``.

    The text is tokenized once without special tokens; when the tokenizer adds a BOS by
    default, every window starts with it (it counts towards ``window``). ``count`` windows are
    returned (all that fit when None): with ``spread`` they are evenly spaced over the whole
    text (diverse topics), otherwise the first ``count``. Fewer windows fit than asked for ->
    ConfigError naming the token count (``strict``), or all that fit (not ``strict``).
    """
    if not isinstance(window, int) or window < 2:
        raise ConfigError(f"window must be an integer >= 2 tokens, got {window!r}")
    if count is not None and (not isinstance(count, int) or count < 1):
        raise ConfigError(f"window count must be a positive integer, got {count!r}")
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = _default_bos(tokenizer)
    body = window - (1 if bos is not None else 0)
    n_fit = len(ids) // body
    if count is not None and not strict:
        count = min(count, n_fit) or None
    if n_fit == 0 or (count is not None and count > n_fit):
        raise ConfigError(
            f"the text has {len(ids)} tokens: {n_fit} windows of {window} fit, "
            f"{count if count is not None else 'at least 1'} asked for")
    n = n_fit if count is None else count
    if spread and n < n_fit:
        starts = [round(i * (n_fit - 1) / max(n - 1, 1)) if n > 1 else 0 for i in range(n)]
    else:
        starts = list(range(n))
    prefix = [bos] if bos is not None else []
    return [prefix + ids[s * body:(s + 1) * body] for s in starts]


def _default_bos(tokenizer) -> int | None:
    """The BOS id when ``encode`` adds one by default, else None."""
    with_special = tokenizer.encode("a")
    plain = tokenizer.encode("a", add_special_tokens=False)
    if len(with_special) > len(plain) and with_special[0] == tokenizer.bos_token_id:
        return int(with_special[0])
    return None

