"""Incremental detokenization on a byte-level BPE tokenizer, and stop strings."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from llmserve.engine.detokenizer import IncrementalDetokenizer, decode_function
from llmserve.engine.stop_strings import check_stop_strings, hold_back

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "你好世界，今天天气很好。我们去公园散步吧。",
    "Emoji: 😀 🎉 👍🏽 ❤️ and accents: café, naïve, façade, Ångström.",
    "def add(a, b):\n    return a + b  # numbers 0123456789",
]
MIXED_TEXT = "Hi 😀! 你好，世界 🎉👍🏽 café — naïve ❤️ end"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (vocab 400) trained on CORPUS: rare characters split into byte tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def stream(detok: IncrementalDetokenizer, token_ids: list[int], step: int = 1) -> list[str]:
    pieces = [detok.add(token_ids[i:i + step]) for i in range(0, len(token_ids), step)]
    return pieces + [detok.flush()]


def test_fixture_splits_characters_across_tokens(tokenizer):
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(MIXED_TEXT)]
    assert any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("step", [1, 2, 3])
def test_multibyte_characters_are_never_broken(tokenizer, step):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt: "), skip_special_tokens=True)
    pieces = stream(detok, tokenizer.encode(MIXED_TEXT), step)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == detok.output_text == MIXED_TEXT


@pytest.mark.parametrize("seed", range(40))
def test_concatenation_equals_decode_for_random_ids(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
    prompt = tokenizer.encode(rng.choice(CORPUS)[: rng.randrange(0, 30)])
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=seed % 2 == 0)
    pieces = stream(detok, ids, step=1 + seed % 3)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=seed % 2 == 0)
    whole = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=seed % 2 == 0)
    assert whole.decode_all(ids) == whole.output_text == "".join(pieces)  # a finished, never streamed sequence


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hello") + [tokenizer.eos_token_id]
    assert "".join(stream(IncrementalDetokenizer(tokenizer, [], True), ids)) == "hello"
    assert "".join(stream(IncrementalDetokenizer(tokenizer, [], False), ids)) == "hello<eos>"


def test_incomplete_character_is_held_until_flush(tokenizer):
    emoji_ids = tokenizer.encode("🎉")
    assert len(emoji_ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [], True)
    assert detok.add(tokenizer.encode("ok") + emoji_ids[:1]) == "ok"
    assert detok.flush() == "\ufffd"


class CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.num_decoded_ids: list[int] = []

    def decode(self, token_ids, skip_special_tokens=False):
        self.num_decoded_ids.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("kind", ["text", "invalid bytes"])
def test_work_per_token_stays_bounded(tokenizer, kind):
    if kind == "text":
        ids = tokenizer.encode(" ".join(CORPUS) * 5)
    else:  # continuation bytes only: every prefix ends in U+FFFD
        ids = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd"][:3] * 100
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, tokenizer.encode(CORPUS[0]), True)
    pieces = stream(detok, ids)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert len(counting.num_decoded_ids) <= 4 * len(ids) and max(counting.num_decoded_ids) <= 16


# --- stop strings ---


def test_stop_string_found_in_the_new_chars():
    assert check_stop_strings("Hello STOP there", 16, ["STOP"], False) == ("STOP", 6)
    assert check_stop_strings("Hello STOP there", 16, ["STOP"], True) == ("STOP", 10)
    assert check_stop_strings("Hello there", 5, ["STOP"], False) is None
    assert check_stop_strings("Hello STOP", 0, ["STOP"], False) is None
    assert check_stop_strings("Hello STOP", 4, [], False) is None


def test_stop_string_spanning_the_boundary_of_new_chars():
    assert check_stop_strings("abc ST", 2, ["STOP"], False) is None
    assert check_stop_strings("abc STOP!", 3, ["STOP"], False) == ("STOP", 4)  # "OP!" is new


def test_old_matches_are_not_reported_again():
    assert check_stop_strings("STOP and more", 5, ["STOP"], False) is None


def test_earliest_completed_stop_string_wins():
    assert check_stop_strings("xx ab yy cd", 11, ["cd", "ab"], False) == ("ab", 3)
    assert check_stop_strings("xabc", 4, ["bc", "abc"], True) == ("abc", 4)
    assert check_stop_strings("xabc", 4, ["bc", "abc"], False) == ("abc", 1)


def test_stop_strings_across_tokens(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    detok = IncrementalDetokenizer(tokenizer, [], True)
    for stop, include, expected in [("fox ju", False, "The quick brown "),
                                    ("lazy", True, "The quick brown fox jumps over the lazy")]:
        detok = IncrementalDetokenizer(tokenizer, [], True)
        match = None
        for token_id in tokenizer.encode(text):
            new_text = detok.add([token_id])
            match = check_stop_strings(detok.output_text, len(new_text), [stop, "zzz"], include)
            if match:
                break
        assert match is not None and match[0] == stop
        assert detok.output_text[: match[1]] == expected


def test_hold_back():
    assert hold_back("Hello S", ["STOP"]) == 1
    assert hold_back("Hello STO", ["STOP", "TOPS"]) == 3
    assert hold_back("Hello", ["STOP"]) == 0
    assert hold_back("ab", ["abc", "b"]) == 2
    assert hold_back("", ["abc"]) == 0
    assert hold_back("xyz", []) == 0


def test_streaming_with_hold_back_never_shows_a_partial_stop_string(tokenizer):
    text, stops = "hello there, hello world, the end", ["hello w", "the end"]
    detok = IncrementalDetokenizer(tokenizer, [], True)
    streamed = ""
    for token_id in tokenizer.encode(text):
        new_text = detok.add([token_id])
        match = check_stop_strings(detok.output_text, len(new_text), stops, False)
        if match:
            streamed += detok.output_text[len(streamed): match[1]]
            break
        visible = len(detok.output_text) - hold_back(detok.output_text, stops)
        assert not detok.output_text[len(streamed):visible].endswith("hello")
        streamed = detok.output_text[:visible]
    assert streamed == "hello there, "


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_function_calls_the_backend_and_decodes_as_the_tokenizer(tokenizer, skip_special_tokens):
    decode = decode_function(tokenizer, skip_special_tokens)
    assert decode.func == tokenizer.backend_tokenizer.decode  # no clean-up: the wrapper adds nothing
    rng = random.Random(0)
    eos = tokenizer.eos_token_id
    for _ in range(200):
        ids = [rng.choice([eos, rng.randrange(len(tokenizer))]) for _ in range(rng.randint(1, 8))]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_function_keeps_the_wrapper_when_it_cleans_up_spaces(tokenizer):
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert decode_function(tokenizer, True).func == tokenizer.decode
    finally:
        tokenizer.clean_up_tokenization_spaces = False
