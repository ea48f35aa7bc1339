"""``SegmentEncoder`` (``gateway/request/segment_encoder.py``): a rendered chat's ids piecewise between
the tokenizer's added tokens, each piece cached, always equal to the whole text's encoding; a
tokenizer whose pieces would differ is caught and encoded whole."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

from gateway.request import segment_encoder
from gateway.request.segment_encoder import SegmentEncoder
from loadtests.harness.tokenizers import IM_END, IM_START, byte_level_tokenizer


def bpe_with_merges() -> Tokenizer:
    """A byte-level BPE with real merges (trained here), so that a piece's ids depend on its neighbours."""

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[IM_START, IM_END], show_progress=False)
    corpus = ["the order was shipped on monday and should arrive within three days"] * 50
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def chat(messages: list[str]) -> str:
    return "".join(f"{IM_START}user\n{m}{IM_END}\n" for m in messages) + f"{IM_START}assistant\n"


texts = st.text(alphabet=st.sampled_from("the order shipped monday é 日\n <>|"), max_size=300)


@settings(max_examples=150, deadline=None)
@given(st.lists(texts, min_size=1, max_size=6))
def test_piecewise_ids_are_the_whole_text_s_ids(messages: list[str]) -> None:
    for tokenizer in (bpe_with_merges(), byte_level_tokenizer()):
        encoder = SegmentEncoder(tokenizer, min_cached_chars=1)
        text = chat(messages)
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
        assert encoder.piecewise


def test_a_conversation_s_earlier_turns_are_not_tokenized_again() -> None:
    tokenizer = bpe_with_merges()
    encoder = SegmentEncoder(tokenizer)
    history = ["the order was shipped on monday and should arrive within three days " * 3]
    encoder.encode(chat(history))
    for turn in range(1, 5):
        history.append(f"turn {turn}: and should it arrive within three days, the order was shipped " * 2)
        misses = encoder.misses
        assert encoder.encode(chat(history)) == tokenizer.encode(chat(history), add_special_tokens=False).ids
        assert encoder.misses == misses + 1  # only the new message was tokenized
    assert encoder.hits >= 1 + 2 + 3


def test_a_tokenizer_whose_pieces_differ_from_the_whole_is_caught_and_encoded_whole() -> None:
    # A normalizer that rewrites text across a special token's edge is invisible to the JSON check:
    # Metaspace prepends a marker to a text's first piece only, so a piece alone gets other ids.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.normalizer = normalizers.Sequence([])

    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[IM_START, IM_END], show_progress=False)
    tokenizer.train_from_iterator(["hello world again and again"] * 20, trainer)
    encoder = SegmentEncoder(tokenizer, min_cached_chars=1)
    text = chat(["hello world", "again and again"])
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    assert encoder.encode(text) == whole  # the check answers with the whole text's ids
    assert not encoder.piecewise
    assert encoder.encode(text) == whole


def test_added_tokens_that_strip_spaces_are_never_split_on() -> None:
    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens([AddedToken("<|sep|>", lstrip=True)])
    assert not SegmentEncoder(tokenizer).piecewise


class Counting:
    """A tokenizer that counts its encodes (what the encoder may call of it)."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.encodes = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> object:
        self.encodes += 1
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def get_added_tokens_decoder(self) -> object:
        return self.inner.get_added_tokens_decoder()

    def to_str(self) -> str:
        return self.inner.to_str()


def test_after_the_first_texts_one_in_verify_every_is_still_checked() -> None:
    counting = Counting(bpe_with_merges())
    encoder = SegmentEncoder(counting)  # type: ignore[arg-type]
    text = chat(["the order was shipped on monday and should arrive within three days " * 2])
    texts = segment_encoder.VERIFY_FIRST + segment_encoder.VERIFY_EVERY
    for _ in range(texts):
        encoder.encode(text)
    # The message's piece once (then cached), the two short pieces ("\n", "assistant\n") every time,
    # and the whole text for the first VERIFY_FIRST texts and the VERIFY_EVERY-th.
    assert counting.encodes == 1 + 2 * texts + segment_encoder.VERIFY_FIRST + 1
