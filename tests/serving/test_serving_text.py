"""serving/text.py: incremental detokenization and stop strings across token boundaries."""

import threading
from pathlib import Path

import pytest

from ced_jax.chat.encoding import PromptEncoder
from serving.testing.mock_engine import ByteTokenizer
from serving.text import HFTokenizer, IncrementalDetokenizer, StreamText

pytestmark = pytest.mark.timeout(30)

TOK = ByteTokenizer()
TINY_TOKENIZER = Path(__file__).resolve().parents[2] / "ced_jax" / "assets" / "tiny" / "tokenizer.json"


def _deltas(tokenizer, ids, context=()):
    d = IncrementalDetokenizer(tokenizer, context)
    out = [d.push(t) for t in ids]
    out.append(d.flush())
    return out


def test_multibyte_characters_never_split():
    text = "aé€😀b"  # 1, 2, 3, 4 and 1 bytes
    deltas = _deltas(TOK, TOK.encode(text))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # the emoji's text arrives with its 4th byte, not before
    assert deltas[:10] == ["a", "", "é", "", "", "€", "", "", "", "😀"]


def test_invalid_bytes_are_released_after_four_tokens():
    ids = [TOK.OFFSET + 0xFF] + TOK.encode("abcd")
    deltas = _deltas(TOK, ids)
    assert "".join(deltas) == "\ufffdabcd"
    assert deltas[0] == ""  # held while it could still be a prefix


def test_hf_byte_level_tokenizer_round_trip():
    tok = HFTokenizer.from_file(TINY_TOKENIZER)
    vocab = tok._tok.get_vocab()
    ids = [vocab["Ġthe"], vocab["Ã"], vocab["©"], vocab["Ġof"], vocab["the"]]  # Ã© = UTF-8 of é
    deltas = _deltas(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == " theé ofthe"
    assert all("\ufffd" not in d for d in deltas)


def _python_steps_while(work) -> int:
    """How many small pieces of Python work this thread does while `work` runs on another thread."""
    done = threading.Event()
    worker = threading.Thread(target=lambda: (work(), done.set()))
    steps = 0
    worker.start()
    while not done.is_set():
        sum(range(200))
        steps += 1
    worker.join()
    return steps


def test_encoding_a_large_text_leaves_the_gil_to_other_threads():
    """Issue 33.7: a near-limit Tokenize slowed a small Generate from 0.1 s to 3-7 s: the Rust encode
    held the GIL, so the event loop stood still. HFTokenizer.encode (and the chat prompt encoder) use
    the GIL-free path. A ratio in one run against the GIL-holding call (measured about 100x)."""
    tok = HFTokenizer.from_file(TINY_TOKENIZER)
    text = ("a plain sentence, then Ünïcödé and 你好 " * 15_000)[:500_000]
    assert tok.encode(text) == tok._tok.encode(text).ids
    holding = _python_steps_while(lambda: tok._tok.encode(text))
    ours = _python_steps_while(lambda: tok.encode(text))
    assert ours >= 10 * max(holding, 1), (ours, holding)
    encoder = PromptEncoder(tok._tok)
    assert _python_steps_while(lambda: encoder.plain(text)) >= 10 * max(holding, 1)


def _run(stop, pieces):
    """Feeds the byte tokens of each piece; returns (text, tokens, stopped, text of each push)."""
    st = StreamText(TOK, stop)
    text, toks, pushes = "", [], []
    for piece in pieces:
        for t in TOK.encode(piece):
            r = st.push(t, payload=t)
            assert r.payloads == r.token_ids
            text += r.text
            toks += r.token_ids
            pushes.append(r.text)
            if r.stopped:
                return text, toks, True, pushes
    r = st.finish()
    return text + r.text, toks + r.token_ids, False, pushes


def test_stop_string_across_tokens_is_cut_and_never_leaks():
    text, toks, stopped, pushes = _run(["STOP"], ["hello ST", "OP world"])
    assert stopped and text == "hello "
    assert TOK.decode(toks) == "hello "
    # "S" and "T" were held back as a possible prefix of "STOP", never streamed
    assert "S" not in "".join(pushes)


def test_false_prefix_is_released_later_and_finish_flushes():
    text, toks, stopped, pushes = _run(["STOP"], ["a STO", "RM ST"])
    assert not stopped and text == "a STORM ST"
    assert TOK.decode(toks) == text
    assert "".join(pushes) == "a STORM "  # the trailing "ST" only came with finish()


def test_earliest_of_several_stops_wins_and_overlapping_prefixes():
    text, _, stopped, _ = _run(["xyz", "abab"], ["aababxyz"])
    assert stopped and text == "a"
    text, _, stopped, _ = _run(["abc"], ["aababc"])
    assert stopped and text == "aab"


def test_stop_string_with_multibyte_characters():
    text, toks, stopped, _ = _run(["é!"], ["café", "!", "more"])
    assert stopped and text == "caf"
    assert TOK.decode(toks) == "caf"


def test_no_stop_strings_streams_immediately():
    st = StreamText(TOK, ())
    assert st.push(TOK.encode("a")[0]).text == "a"
