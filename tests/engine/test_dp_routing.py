"""What the data-parallel front end routes on: a prompt's token ids and cache salt,
found without ever failing a request (a malformed prompt is its replica's to refuse)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.data_parallel import ReplicaRefusal, routing_tokens
from pagedserve.errors import InvalidRequestError, PromptTooLongError
from tests.hypothesis_budget import examples


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_routing_tokens_of_each_prompt_form():
    tok = _Tok()
    assert routing_tokens("ab", tok) == ([97, 98], None)
    assert routing_tokens([5, 6], tok) == ([5, 6], None)
    assert routing_tokens({"prompt": "ab", "cache_salt": "s"}, tok) == ([97, 98], "s")
    assert routing_tokens({"prompt_token_ids": [1], "prompt": "zz"}, tok) == ([1], None)  # the ids win, as in the engine
    assert routing_tokens("ab", None) == (None, None)  # no tokenizer: routed by load alone
    for bad in ("", [], [1, "x"], [True], [-1], {"prompt": 3}, None, 4.5, [2**70]):
        ids, _ = routing_tokens(bad, tok)
        assert ids in (None, [])


json_like = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                         lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids,
                                                                                    max_size=4), max_leaves=12)


@settings(max_examples=examples(300), deadline=None)
@given(prompt=json_like | st.dictionaries(st.sampled_from(["prompt", "prompt_token_ids", "cache_salt"]), json_like))
def test_routing_never_fails_a_request(prompt):
    ids, salt = routing_tokens(prompt, _Tok())
    assert ids is None or all(type(t) is int and t >= 0 for t in ids)
    assert salt is None or isinstance(salt, str)


def test_a_refusal_travels_back_as_the_same_kind_of_error():
    err = ReplicaRefusal.of(InvalidRequestError("too long", param="max_tokens")).error()
    assert isinstance(err, InvalidRequestError) and err.param == "max_tokens" and str(err) == "too long"
    assert not isinstance(err, PromptTooLongError)
    long = ReplicaRefusal.of(PromptTooLongError("the prompt has 9 tokens", param="prompt")).error()
    assert isinstance(long, PromptTooLongError) and long.param == "prompt"  # (its API code: context_length_exceeded)
    plain = ReplicaRefusal.of(ValueError("bad")).error()
    assert isinstance(plain, ValueError) and plain.param is None
    assert not isinstance(ReplicaRefusal.of(KeyError("x")).error(), ValueError)


def test_an_image_for_a_text_model_is_refused_as_one_engine_refuses_it():
    """A text model behind replicas: the image's refusal says the model takes none (it said
    to run one replica, which would refuse it all the same); a vision model's says replicas
    do not serve images yet."""
    import pytest

    from pagedserve.engine.data_parallel import ReplicaInfo, ReplicaSet
    from pagedserve.errors import ImageInputError

    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                          {"type": "text", "text": "what is it?"}]}]
    replicas = ReplicaSet.__new__(ReplicaSet)  # (the refusal comes before any replica is asked)
    for takes_images, said in ((False, "this model takes no images"), (True, "not served with data-parallel")):
        replicas.info = ReplicaInfo(None, None, 100, {}, "guidance", 64, 1000, 16, 10, {}, "CPU", takes_images)
        with pytest.raises(ImageInputError, match=said):
            replicas.encode_chat(image)
