"""The indexer's scores on CPU: an XLA FFI custom call (`pallas_kernels/csrc/index_scores.cc`) that
reads each FP4 key packed from its page through the page table, so no f32 copy of the keys is written
(64 MB per layer for one 128K-token row at ratio 1 on the XLA path).

The contract is `common`'s (the signature and the result of `reference.index_scores`). Each q . k
is summed per 32-value block (exact: FP4 times FP4) and the blocks added in order; XLA's dot adds the
same exact products in its own order, so the two agree bit for bit wherever a score's dot is exact in
f32 (its blocks' scales within about 2^10 of each other), and past that only a last-bit difference
of the dot that the bf16 roundings after it would have to carry (none in
tests/pallas_kernels/test_cpu_kernels.py, blocks scaled up to 2^24 apart included).
The AVX-512 loop runs where the CPU has it, else a portable one (`portable=True` forces it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _cpu
from pallas_kernels.indexer.common import validate_inputs


def index_scores(q, weights, key_pages, page_table, n_visible, *, portable: bool = False) -> jax.Array:
    b, t, _, _ = validate_inputs(q, weights, key_pages, page_table, n_visible)
    _cpu.require()
    width = page_table.shape[1] * key_pages.shape[1]
    call = jax.ffi.ffi_call("ced_index_scores", jax.ShapeDtypeStruct((b, t, width), jnp.float32))
    return call(
        q, weights, key_pages, page_table.astype(jnp.int32), n_visible.astype(jnp.int32),
        portable=np.int64(bool(portable)),
    )  # fmt: skip
