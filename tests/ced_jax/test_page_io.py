"""ced_jax/engine/page_io.py: whole pages device -> host blobs -> device, bit for bit, at the 890-byte
layout."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ced_jax.cache import init_paged_cache, kv_bytes_per_token
from ced_jax.config import preset
from ced_jax.engine.page_io import PageLayout, read_pages, write_pages

pytestmark = pytest.mark.timeout(120)

PAGE = 16


def _random_state(cfg, num_pages: int, seed: int):
    """A tiny state whose every buffer (page and per-slot) holds random bytes/values."""
    state = init_paged_cache(cfg, max_slots=2, page_size=PAGE, num_pages=num_pages)
    rng = np.random.default_rng(seed)
    fill = lambda a: jnp.asarray(
        rng.integers(0, 256, a.shape, dtype=np.uint8)
        if a.dtype == jnp.uint8
        else rng.standard_normal(a.shape, np.float32)
    )
    return jax.tree.map(fill, state)


def test_page_bytes_are_the_device_kv_bytes():
    for name, page in (("tiny", PAGE), ("v41-flash", 16), ("v41-flash", 128)):
        cfg = preset(name)
        layout = PageLayout.for_config(cfg, page)
        state = jax.eval_shape(
            lambda cfg=cfg, page=page: init_paged_cache(cfg, max_slots=1, page_size=page, num_pages=3)
        )
        layout.check_state(state)
        per_token = {"tiny": 210, "v41-flash": 890}[name]  # spec 2.4 / README (not derived from the layout)
        assert kv_bytes_per_token(state) == per_token
        assert layout.page_bytes == per_token * page
        # the buffers of both kinds of every KV source are in the layout, once each
        assert sorted((s.kind, s.source) for s in layout.segments) == sorted(
            (k, src) for k in ("kv", "index_k") for src in getattr(state, k)
        )


def test_round_trip_device_host_device_is_bit_identical():
    cfg = preset("tiny")
    assert len(cfg.kv_source_layer_ids) >= 2  # pages of several sources, with different ratios
    layout = PageLayout.for_config(cfg, PAGE)
    src = _random_state(cfg, 8, seed=0)
    dst = _random_state(cfg, 8, seed=1)
    layout.check_state(src)
    pages_from = np.array([5, 1, 6], np.int32)
    pages_to = np.array([0, 7, 3], np.int32)

    read = jax.jit(read_pages)
    write = jax.jit(write_pages)
    blobs = layout.pack(read(src, pages_from))
    assert [len(b) for b in blobs] == [layout.page_bytes] * 3

    # A blob is the page's device bytes in the documented order: per source, main entries then index keys.
    for i, p in enumerate(pages_from):
        want = b"".join(
            np.asarray(getattr(src, kind)[str(s)][p]).tobytes()
            for s in cfg.kv_source_layer_ids
            for kind in ("kv", "index_k")
        )
        assert blobs[i] == want

    out = write(dst, pages_to, layout.unpack(blobs))
    for kind in ("kv", "index_k"):
        for s, buf in getattr(out, kind).items():
            got, before, orig = (
                np.asarray(buf),
                np.asarray(getattr(dst, kind)[s]),
                np.asarray(getattr(src, kind)[s]),
            )
            np.testing.assert_array_equal(got[pages_to], orig[pages_from])
            untouched = np.setdiff1d(np.arange(8), pages_to)
            np.testing.assert_array_equal(got[untouched], before[untouched])
    # per-slot state is not part of a page and is left alone
    for field in ("window", "state_kv", "state_score"):
        for k, v in getattr(out, field).items():
            np.testing.assert_array_equal(np.asarray(v), np.asarray(getattr(dst, field)[k]))
    # and reading the written pages back gives the same blobs
    assert layout.pack(read(out, pages_to)) == blobs


def test_bad_inputs_name_the_field():
    cfg = preset("tiny")
    layout = PageLayout.for_config(cfg, PAGE)
    state = init_paged_cache(cfg, max_slots=1, page_size=PAGE, num_pages=4)
    contents = read_pages(state, np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="pages: ids must lie"):
        read_pages(state, np.array([4], np.int32))
    with pytest.raises(ValueError, match="repeated"):
        write_pages(state, np.array([1, 1], np.int32), contents)
    bad = {**contents, "kv": {**contents["kv"], "2": contents["kv"]["2"][:, :3]}}
    with pytest.raises(ValueError, match=r"contents\['kv'\]\['2'\]"):
        write_pages(state, np.array([0, 1], np.int32), bad)
    with pytest.raises(ValueError, match=r"blobs\[1\]"):
        layout.unpack([b"\0" * layout.page_bytes, b"\0"])
    with pytest.raises(ValueError, match="page_size"):
        PageLayout.for_config(cfg, 3)
    other = dataclasses.replace(state, page_size=32)
    with pytest.raises(ValueError, match="page_size"):
        layout.check_state(other)


def test_fingerprint_names_config_layout_and_weights():
    tiny = PageLayout.for_config(preset("tiny"), PAGE)
    assert tiny.fingerprint() == PageLayout.for_config(preset("tiny"), PAGE).fingerprint()
    assert tiny.fingerprint() != PageLayout.for_config(preset("tiny"), 2 * PAGE).fingerprint()
    assert tiny.fingerprint() != PageLayout.for_config(preset("v41-flash"), PAGE).fingerprint()
    assert tiny.fingerprint() != tiny.fingerprint(b"other weights")
    changed = preset("tiny").replace(vocab_size=preset("tiny").vocab_size + 2)
    assert tiny.fingerprint() != PageLayout.for_config(changed, PAGE).fingerprint()
