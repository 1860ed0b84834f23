"""The notebook API's `generate` (issue 36.5): a batch of prompts in one program, max_new_tokens,
top_p / top_k, stop strings, streaming; and `logits` reusing its compiled programs for a new prompt
length. Greedy results are compared with each prompt generated alone, sampled ones with the sampler's
own definitions (top_k 1 and a vanishing top_p keep only the most likely token)."""

from __future__ import annotations

import contextlib
import threading

import jax
import numpy as np
import pytest

import ced_jax

PROMPTS = ["hello world", "a longer prompt than the first, to prefill in pieces of other lengths", [5, 6, 7]]


@pytest.fixture(scope="module")
def model():
    # A small prefill chunk: the longer prompt takes several lockstep pieces beside the short ones.
    return ced_jax.load("tiny", prefill_chunk=16)


@contextlib.contextmanager
def compiles():
    """Counts the executables JAX builds on this thread (fresh or from the persistent cache)."""
    seen = [0]
    me = threading.get_ident()

    def on_duration(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and threading.get_ident() == me:
            seen[0] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)


def test_a_batch_is_each_prompt_alone(model):
    alone = [model.generate(p, 6, stop_at_eos=False) for p in PROMPTS]
    together = model.generate(PROMPTS, max_new_tokens=6, stop_at_eos=False)
    assert [r["token_ids"] for r in together] == [r["token_ids"] for r in alone]
    assert [r["prompt_ids"] for r in together] == [r["prompt_ids"] for r in alone]
    assert [r["text"] for r in together] == [r["text"] for r in alone]
    assert all(r["finish_reason"] == "length" for r in together)
    # A row that ends (here at a stop string) stops there while the others go on.
    stopped = model.generate(
        PROMPTS, 6, stop_at_eos=False, stop=[model.decode_text(alone[0]["token_ids"][:3])]
    )
    assert stopped[0]["finish_reason"] == "stop" and len(stopped[0]["token_ids"]) == 3
    assert stopped[1]["token_ids"] == alone[1]["token_ids"]


def test_max_new_tokens_and_its_alias(model):
    a = model.generate("hi", max_new_tokens=4, stop_at_eos=False)
    assert (
        a
        == model.generate("hi", max_tokens=4, stop_at_eos=False)
        == model.generate("hi", 4, stop_at_eos=False)
    )
    assert len(a["token_ids"]) == 4
    with pytest.raises(ValueError, match="max_new_tokens 4 and max_tokens 5"):
        model.generate("hi", max_new_tokens=4, max_tokens=5)


def test_top_k_and_top_p_keep_the_most_likely_token(model):
    greedy = model.generate("hello world", 12, stop_at_eos=False)["token_ids"]
    for seed in (1, 2):
        assert (
            model.generate("hello world", 12, temperature=1.5, top_k=1, seed=seed, stop_at_eos=False)[
                "token_ids"
            ]
            == greedy
        )
        assert (
            model.generate("hello world", 12, temperature=1.5, top_p=1e-6, seed=seed, stop_at_eos=False)[
                "token_ids"
            ]
            == greedy
        )
    sampled = model.generate("hello world", 12, temperature=1.5, seed=1, stop_at_eos=False)["token_ids"]
    assert sampled != greedy  # without them the draw is not the argmax
    for bad, field in ((dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"), (dict(seed=-1), "seed")):
        with pytest.raises(ValueError, match=field):
            model.generate("hi", 2, **bad)


def test_stop_strings_cut_the_text(model):
    full = model.generate("hello world", 20, stop_at_eos=False)
    text = full["text"].rstrip("\ufffd")
    stop = text[4:7]
    assert text.find(stop) == 4
    out = model.generate("hello world", 20, stop=stop, stop_at_eos=False)
    assert out["text"] == text[:4] and out["finish_reason"] == "stop"
    assert out["token_ids"] == full["token_ids"][: len(out["token_ids"])] and len(out["token_ids"]) < 20
    with pytest.raises(ValueError, match="stop"):
        model.generate("hi", 2, stop=[""])


def test_streaming_yields_the_tokens_as_they_come(model):
    want = model.generate(PROMPTS[:2], 5, stop_at_eos=False)
    events = model.generate(PROMPTS[:2], 5, stop_at_eos=False, stream=True)
    assert not isinstance(events, (list, dict))
    events = list(events)
    for i, r in enumerate(want):
        mine = [e for e in events if e["index"] == i]
        assert [e["token_id"] for e in mine] == r["token_ids"]
        assert "".join(e["text"] for e in mine) == r["text"]


def test_batch_refuses_what_takes_one_prompt(model):
    with pytest.raises(ValueError, match="one prompt"):
        model.generate(["a", "b"], 2, dspark=1)


def test_logits_reuse_their_programs_for_a_new_prompt_length(model):
    model.logits(list(range(3, 3 + 20)))  # compiles the bucket of 32 positions
    with compiles() as seen:
        out = model.logits(list(range(3, 3 + 27)))
    assert seen[0] == 0
    assert out["prefill_logits_full"].shape == (27, model.cfg.vocab_size)
    # The padding changes nothing: the first 20 rows are those of the 20-token prompt.
    short = model.logits(list(range(3, 3 + 20)))["prefill_logits_full"]
    np.testing.assert_array_equal(out["prefill_logits_full"][:20], short)


def test_chat_renders_as_the_server_does_and_parses_the_answer(model):
    """`Model.chat_prompt` is the HTTP API's prompt for the same conversation (one encoder,
    `ced_jax.chat`); `chat` is `generate` on it, its text split as the reference parser splits it."""
    import json

    import tokenizers

    from serving.config import ServeConfig
    from serving.http.convert import CHAT, Converter
    from serving.model_names import ModelCatalog

    converter = Converter(
        tokenizers.Tokenizer.from_file(str(model.tokenizer_path)),
        catalog=ModelCatalog(ServeConfig().http_models), max_context=4096, max_tokens_limit=64,
        max_logprobs=5,
    )  # fmt: skip
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    for kwargs, extra in (({}, {}), ({"effort": "low"}, {"reasoning_effort": "low"}),
                          ({"thinking": False}, {"thinking": {"type": "disabled"}})):  # fmt: skip
        body = {"model": "deepseek-flash", "messages": messages, **extra}
        served = converter.prepare(CHAT, json.dumps(body).encode()).prompt_ids
        assert model.chat_prompt(messages, **kwargs) == list(served), kwargs
    out = model.chat(messages, thinking=False, max_new_tokens=6, stop_at_eos=False)
    plain = model.generate(model.chat_prompt(messages, thinking=False), 6, stop_at_eos=False)
    assert out["token_ids"] == plain["token_ids"]
    text = model.tokenizer.decode(plain["token_ids"], skip_special_tokens=False)
    assert out["message"]["content"] == text and out["message"]["reasoning_content"] == ""
    with pytest.raises(ValueError, match="stream"):
        model.chat(messages, stream=True)


def test_a_second_load_of_the_same_model_compiles_nothing(model):
    """Compiled programs are shared process-wide by config, layout and shapes (`Programs.shared`)."""
    want = model.generate("hi there", 3, stop_at_eos=False)
    model.logits([1, 2, 3])
    again = ced_jax.load("tiny", prefill_chunk=16)
    with compiles() as seen:
        got = again.generate("hi there", 3, stop_at_eos=False)
        again.logits([4, 5, 6, 7])
    assert seen[0] == 0 and got == want
