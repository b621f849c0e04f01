"""Write a tiny, offline-trained tokenizer next to a tiny model so the OpenAI server takes text.

The tiny models in :mod:`hybridkv.cli.harness.tiny_models` have random weights and a 2048-token
vocabulary; the end-to-end tests feed them token ids with ``skip_tokenizer_init=True``. The
agentic demo talks to ``/v1/completions`` with text like a real agent would, so the model
folder needs a tokenizer. No model hub is reachable, so one is trained here:

* byte-level BPE (any text encodes, nothing maps to an unknown token), trained with the
  ``tokenizers`` library on a built-in deterministic corpus made of :data:`WORDS`;
* every word of :data:`WORDS`, written with a leading space, and ``"\\n"`` encode to exactly
  one token each, so :mod:`hybridkv.cli.agentic_demo` can build prompts of an exact token
  length from those words (checked when the tokenizer is written);
* special tokens ``<pad>``, ``</s>``, ``<s>`` get ids 0, 1, 2, the ids of the tiny models'
  ``pad_token_id``/``eos_token_id``/``bos_token_id``; ``<s>`` is prepended to every prompt;
* the vocabulary is padded to exactly ``vocab_size`` with tokens that encoding never emits
  (two words glued together), so that every id the model can sample decodes to text.

Deterministic (same files for the same ``vocab_size``), quick (well under a second to
train) and idempotent (a stamp file, written last, skips the work when current).
"""

from __future__ import annotations

import json
import os
import pathlib
import random

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "SPECIAL_IDS",
    "WORDS",
    "write_tiny_tokenizer",
]

# Bump when the corpus, the word list or the training recipe changes.
_FORMAT_VERSION = 1
_STAMP = ".hybridkv_tiny_tokenizer.json"

PAD, EOS, BOS = "<pad>", "</s>", "<s>"
# Must match pad/eos/bos ids of the tiny model configs (cli/harness/tiny_models.py).
SPECIAL_IDS: dict[str, int] = {PAD: 0, EOS: 1, BOS: 2}

# The corpus vocabulary: words an agent transcript is made of. Kept small enough that BPE
# merges every one of them into a single token well before the vocabulary is full.
WORDS: tuple[str, ...] = tuple(
    """
    the a an and or not of to in on at by for from with as is are was be been has have
    had do does did can will would should could may must this that these those it its
    we you they he she i me my our your their them us all any each every some no one two
    three four five six seven eight nine ten first last next new old same other more most
    less few many much very also only just then than now here there when where why how
    what which who if else while until after before because so but yet about into over
    under again once user assistant system tool call calls result results error errors
    warning info debug trace file files path paths line lines code function functions
    class method value values key keys list lists map set type types name names test tests
    run runs build builds check checks step steps task tasks plan plans read write open
    close find search replace edit patch diff commit branch merge repo module package
    import export return returns input output request response server client cache hit
    miss block blocks token tokens model models layer layers prompt prompts query answer
    data table row rows column columns index memory disk store load save copy move delete
    create update start stop wait retry fail fails failed pass passed ok done ready time
    size count number string bytes config option options flag flags default status log
    logs message messages event events node nodes graph state shell command commands
    argument arguments report summary note notes fix bug issue issues change changes
    version release job jobs queue worker workers thread process port host local remote
    network page pages text json yaml field fields object array empty null true false
    good bad small large fast slow long short high low full part
    """.split()
)

_LINE_WORDS = 12
_CORPUS_LINES = 400
_CORPUS_SEED = 20240607


def _corpus() -> list[str]:
    """Deterministic training text: every word appears often, always after a space.

    Lines start with a space so that a word is always seen as `` word``; the byte-level
    pre-tokenizer then splits ``"\\n word"`` into ``"\\n"`` and `` word``, the two kinds of
    pieces the demo builds its prompts from.
    """
    rng = random.Random(_CORPUS_SEED)
    lines = [" " + " ".join(WORDS[i : i + _LINE_WORDS]) for i in range(0, len(WORDS), _LINE_WORDS)]
    for _ in range(_CORPUS_LINES):
        lines.append(" " + " ".join(rng.choice(WORDS) for _ in range(_LINE_WORDS)))
    return ["\n".join(lines[i : i + 20]) + "\n" for i in range(0, len(lines), 20)]


def _train(vocab_size: int):
    """Train the byte-level BPE and pad its vocabulary to exactly ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = sorted(SPECIAL_IDS, key=SPECIAL_IDS.get)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)

    # Pad the vocabulary: the model samples from all vocab_size ids and every one must
    # decode. Two words glued together (" the" + " cache" -> "Ġthe" "Ġcache" as one entry)
    # decode to ordinary text, and the pre-tokenizer never produces them when encoding.
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    pieces = [_byte_level(" " + w) for w in WORDS]
    rng = random.Random(_CORPUS_SEED + 1)
    while len(vocab) < vocab_size:
        glued = rng.choice(pieces) + rng.choice(pieces)
        if glued not in vocab:
            vocab[glued] = len(vocab)
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, SPECIAL_IDS[BOS])]
    )
    return tok


def _byte_level(text: str) -> str:
    """``text`` in the byte-level alphabet (a space is ``Ġ``), as BPE vocab entries are."""
    from tokenizers import pre_tokenizers

    return "".join(
        piece
        for piece, _ in pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=False
        ).pre_tokenize_str(text)
    )


def _check(tok, vocab_size: int) -> None:
    """Fail loudly if the tokenizer breaks what the model or the demo relies on."""
    for token, want in SPECIAL_IDS.items():
        got = tok.token_to_id(token)
        if got != want:
            raise RuntimeError(
                f"tiny tokenizer: special token {token!r} has id {got}, the tiny model configs "
                f"expect {want} (pad/eos/bos = 0/1/2)"
            )
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tiny tokenizer: vocab size {tok.get_vocab_size()} != model vocab size {vocab_size}"
        )
    multi = [w for w in WORDS if len(tok.encode(" " + w, add_special_tokens=False).ids) != 1]
    if multi or len(tok.encode("\n", add_special_tokens=False).ids) != 1:
        raise RuntimeError(
            f"tiny tokenizer: vocab size {vocab_size} is too small to make every demo word a "
            f"single token (not merged: {multi[:10]}); raise vocab_size or shorten WORDS"
        )


def _stamp_for(vocab_size: int) -> dict:
    return {"vocab_size": vocab_size, "format_version": _FORMAT_VERSION}


def _is_current(out: pathlib.Path, vocab_size: int) -> bool:
    try:
        stamp = json.loads((out / _STAMP).read_text())
    except (OSError, ValueError):
        return False
    return (out / "tokenizer.json").is_file() and stamp == _stamp_for(vocab_size)


def write_tiny_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 2048) -> pathlib.Path:
    """Train the tiny tokenizer and save it (HF format) into ``out_dir``; return the folder.

    ``vocab_size`` must equal the model's ``vocab_size`` so every sampled id decodes. Saved
    with ``PreTrainedTokenizerFast.save_pretrained`` (``tokenizer.json`` +
    ``tokenizer_config.json``), which is what vLLM's ``AutoTokenizer`` loads. Idempotent: a
    stamp file written last marks a complete, current folder.
    """
    out = pathlib.Path(out_dir)
    if _is_current(out, vocab_size):
        return out
    if vocab_size < 1 + max(SPECIAL_IDS.values()) + 256:
        raise ValueError(f"vocab_size {vocab_size} cannot hold 3 special + 256 byte tokens")
    from transformers import PreTrainedTokenizerFast

    tok = _train(vocab_size)
    _check(tok, vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    (out / _STAMP).unlink(missing_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out))
    (out / _STAMP).write_text(json.dumps(_stamp_for(vocab_size)) + "\n")
    return out


if __name__ == "__main__":
    import sys

    print(write_tiny_tokenizer(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2048))
