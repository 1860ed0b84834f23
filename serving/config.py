"""ServeConfig: the runtime knobs of a server (shapes, buckets, limits, ports), never model structure.

The one place serving shapes and their defaults are declared: `ced-jax serve` takes its flags'
defaults from these fields, and `serving.engine.jax_engine.JaxEngine` is built from a ServeConfig. The shape
fields (`max_slots`, `page_size`, `num_pages`, `max_context`, `prefill_buckets`) are what an engine
is built with; `check_engine` verifies that the engine actually was, so the scheduler's host-side
tables and the engine's device buffers cannot disagree (an engine not built from this config, such
as `serving.testing.mock_engine.MockEngine`, is checked all the same). The policy fields only concern the
scheduler and server.
"""

from __future__ import annotations

import dataclasses
import math

from ced_jax.options import PREFILL_MODES
from serving.accounting import PricingConfig
from serving.admission import AdmissionLimits
from serving.engine.protocol import EngineSpec, check_shapes
from serving.files import MIB, FilesConfig
from serving.flags import (
    ADMISSION,
    AUTO,
    IMAGES,
    PREFILL_MODE_HELP,
    SCHEDULING,
    SERVER,
    SHAPES,
    TENANTS,
    Flag,
    flag,
    flags,
    named,
    port_or_off,
    whole_number,
    whole_number_or_auto,
    whole_numbers,
)
from serving.image_fetch import ImageFetchConfig, ImageInputConfig
from serving.model_names import ModelNames, parse_alias
from serving.tenants import ApiKeys

# The fields that name a TCP port the server listens on (checked to be in 0..65535).
PORT_FIELDS = ("port", "metrics_port", "http_port")


# Decode batches of fewer rows than this compute a row differently from batches of this many or more
# on XLA:CPU (its matmul kernels; measured on tiny, tests/serving/test_serving_jax.py); from this many
# rows up a row's result is the same in every batch.
INVARIANT_DECODE_ROWS = 8

# Tokens per step of a long prompt prefilled alone (`ServeConfig.long_prefill_chunk`'s default): on
# tiny / XLA:CPU about 2 s of work, so an arrival waits at most that long for its own prefill.
LONG_PREFILL_CHUNK = 2048


# Prompt tokens per prefill call (`ServeConfig.prefill_buckets`' one chunk by default, --prefill-chunk).
PREFILL_CHUNK = 128


def serve_flags() -> list[tuple[tuple[str, ...], dataclasses.Field, Flag]]:
    """(path, field, flag) of every flag of the serve command, in order: of a `ServeConfig` field
    (path: its name), or of a field of a config nested in one (path: the two names, e.g.
    ("http_files", "ttl_s")), at the place of the ServeConfig field; a field with two flags
    (api_keys) has two rows."""
    found = []
    for f in dataclasses.fields(ServeConfig):
        if "flags" in f.metadata:
            found += [((f.name,), f, declared) for declared in f.metadata["flags"]]
        elif dataclasses.is_dataclass(f.default):
            found += [
                ((f.name, inner.name), inner, declared)
                for inner in dataclasses.fields(f.default)
                for declared in inner.metadata.get("flags", ())
            ]
    return found


def _one_chunk(text: str) -> tuple[int, ...]:
    """--prefill-chunk N: prefill_buckets of that one chunk length."""
    return (whole_number(text),)


def _one_key(key: str) -> ApiKeys:
    """--api-key KEY (or "KEY NAME"): the keys of a key file of that one line."""
    try:
        return ApiKeys.parse([key], source="the key")
    except ValueError as e:
        raise ValueError(str(e).replace(" line 1", "")) from None


def _model_aliases(values: list[str]) -> ModelNames:
    """--model-alias, repeated: the served names with these aliases (NAME or NAME=thinking|non-thinking)."""
    return ModelNames(extra_aliases=tuple(parse_alias(v) for v in values))


def default_long_prefill_chunk(max_context: int) -> int:
    """`ServeConfig.long_prefill_chunk`'s default: LONG_PREFILL_CHUNK from 4x that context on, below
    it 0 (a whole prompt is a few steps of the page program; the extra compile does not pay)."""
    return LONG_PREFILL_CHUNK if max_context >= 4 * LONG_PREFILL_CHUNK else 0


def default_decode_buckets(max_slots: int, *, batch_invariant: bool = True) -> tuple[int, ...]:
    """Powers of two below max_slots, then max_slots (see `decode_buckets`): from
    min(INVARIANT_DECODE_ROWS, max_slots) when batch-invariant, from 1 otherwise."""
    sizes, b = [], min(INVARIANT_DECODE_ROWS, max_slots) if batch_invariant else 1
    while b < max_slots:
        sizes.append(b)
        b *= 2
    return (*sizes, max_slots)


def default_context_buckets(max_context: int, page_size: int) -> tuple[int, ...]:
    """8192 tokens (rounded up to whole pages) and x8 from there, below max_context, then max_context
    (see `decode_context_buckets`)."""
    widths, t = [], -(-8192 // page_size) * page_size
    while t < max_context:
        widths.append(t)
        t *= 8
    return (*widths, max_context)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig:
    # Shapes (static; every program is compiled for them at start-up).
    max_slots: int = flag(
        32,
        "--max-slots",
        "concurrent sequences in the decode batch",
        group=SHAPES,
    )
    page_size: int = flag(16, "--page-size", "tokens per KV page", group=SHAPES)
    # KV pages in the buffer; None: enough for every slot at max_context (max_slots * max_context /
    # page_size), filled in at construction, so `num_pages` of a ServeConfig is always a number.
    num_pages: int | None = flag(
        None,
        "--num-pages",
        "KV pages in the buffer (default: max-slots x max-context / page-size)",
        group=SHAPES,
    )
    # Prompt + generated tokens of one request; a multiple of page_size. The command's default, auto,
    # is sized from the model and the memory there (ced_cli.serve), before the config is built.
    max_context: int = flag(
        2048,
        "--max-context",
        "prompt + generated tokens per request; auto: the largest the KV pool holds for --max-slots "
        "sequences (an accelerator's memory to 90 %% after weights and activations, on CPU 256 MiB of KV, "
        "or --num-pages), at most the model's own context",
        group=SHAPES,
        command_default=AUTO,
        parse=whole_number_or_auto,
    )
    # Chunk lengths, ascending; the largest a multiple of page_size. The command compiles one.
    prefill_buckets: tuple[int, ...] = flag(
        (PREFILL_CHUNK,),
        "--prefill-chunk",
        "prompt tokens per prefill call",
        group=SHAPES,
        command_default=str(PREFILL_CHUNK),
        parse=_one_chunk,
    )
    # Batch invariance, a guarantee: a request's tokens and log-probabilities are bit-identical
    # whatever else is batched with it (tests/serving/test_serving_jax.py: a request alone and among
    # 31 others). It costs padding: decode runs at least INVARIANT_DECODE_ROWS rows and prefill at
    # one row count (below), so a lone stream pays for 8 rows. Off, decode and prefill run at the
    # batch in use (decode buckets from 1, prefill rows (1, n)), and a request's output may change
    # in the last bits with its neighbours. Explicit buckets that break it are refused while it is on.
    batch_invariant: bool = flag(
        True,
        "--batch-invariant",
        "guarantee that a request's tokens and log-probabilities are bit-identical whatever else is"
        " batched with it: decode runs at least 8 rows and prefill at one row count, padded "
        "(default: on). --no-batch-invariant runs decode and prefill at the batch in use (a lone "
        "stream at 1 row: faster, its output may change in the last bits with its neighbours)",
        group=SHAPES,
    )
    # Overlap scheduling: once a plain decode step's tokens are on the host, the next step is
    # dispatched before they are handled (text, stop strings, events, metrics) and before the next
    # round of admission, so that host work runs while the device computes. A request that a stop
    # string ends costs its row one extra step, whose result is dropped. Off: every step's tokens are
    # handled before the next dispatch (the device idles meanwhile). Speculative (DSpark) steps need
    # their predecessor's drafts and are never overlapped.
    overlap_schedule: bool = flag(
        True,
        "--overlap-schedule",
        "dispatch the next decode step as soon as a step's tokens are on the host, and handle them "
        "(text, stop strings, events) and admit new requests while the device runs it (default: "
        "on). A request ended by a stop string costs its row one dropped step",
        group=SHAPES,
    )
    # Decode batch sizes compiled at start-up; a step runs the smallest that holds its active rows.
    # None: powers of two up to max_slots, from min(INVARIANT_DECODE_ROWS, max_slots) (batch
    # invariant) or 1.
    decode_buckets: tuple[int, ...] | None = None
    # Prefill batch sizes compiled at start-up (rows of one prefill program: each row one request's
    # chunk); a step's chunks run in the smallest that holds them, padded with idle rows. None: one
    # size, min(4, max_slots), when batch-invariant; else (1, min(4, max_slots)). Why one: on XLA:CPU a
    # row's prefill logits differ between programs of different row counts (measured on tiny: 1 row
    # vs 2 or 4 vs 8, on a page that ends mid-way), so with several sizes a request's output, and a
    # prefix-cache hit computed beside other requests, depend on what else is prefilled; one size
    # keeps it exact at the cost of idle rows (BENCHMARKS.md, Serving).
    prefill_rows: tuple[int, ...] | None = flag(
        None,
        "--prefill-rows",
        "requests prefilled together: the row counts of the compiled prefill programs, ascending "
        "(e.g. 4 or 2,4; default: min(4, --max-slots), and 1 too with --no-batch-invariant); one count "
        "keeps prefix-cache hits bit-identical to cold runs on XLA:CPU, several (only with "
        "--no-batch-invariant) trade that for less padding",
        group=SHAPES,
        parse=whole_numbers("4 or 2,4"),
    )
    # Decode page-table widths (tokens of context) compiled at start-up: a decode step reads its rows'
    # page tables only up to the smallest width that holds its longest row, so its cost follows the
    # context in use rather than max_context (the indexer scores every compressed entry its table
    # reaches: on tiny, a 4K-token row in a table of 128K tokens decodes as slowly as a 128K-token
    # one). The result is the same bit for bit at every width. Ascending multiples of page_size up
    # to max_context, which is added last when missing; None: 8192 tokens and x8 from there, below
    # max_context, then max_context (one width when max_context <= 8192). Each width multiplies the
    # compiled decode programs (decode_buckets, and the DSpark widths).
    decode_context_buckets: tuple[int, ...] | None = flag(
        None,
        "--decode-context-buckets",
        "page-table widths of the compiled prefill and decode programs, in tokens, ascending "
        "(e.g. 8192,65536; --max-context is added last): a step reads its rows' page tables only up "
        "to the smallest width that holds its longest row, so its cost follows the context in use, "
        "not --max-context (same tokens at every width). Default: 8192 and x8 from there below "
        "--max-context; each width is another set of compiled programs",
        group=SHAPES,
        metavar="TOKENS",
        parse=whole_numbers("8192,65536"),
    )

    # Admission and request limits.
    max_running: int | None = flag(
        None,
        "--max-running",
        "requests holding a slot (default: --max-slots)",
        group=ADMISSION,
    )  # requests holding a slot; None = max_slots
    max_queued: int = flag(
        256,
        "--max-queued",
        "waiting requests; beyond: RESOURCE_EXHAUSTED",
        group=ADMISSION,
    )  # requests waiting for a slot; beyond running + queued: RESOURCE_EXHAUSTED
    # Largest accepted GenerateRequest.max_tokens. The command's default, auto, is max_context.
    max_tokens_limit: int = flag(
        1024,
        "--max-tokens-limit",
        "largest accepted max_tokens; auto: --max-context",
        group=ADMISSION,
        command_default=AUTO,
        parse=whole_number_or_auto,
    )
    default_max_tokens: int = 256  # when the request leaves max_tokens at 0
    max_logprobs: int = 20  # largest accepted GenerateRequest.logprobs (<= the engine's)
    max_stop_strings: int = 16
    max_stop_string_length: int = 256
    max_request_id_length: int = 256
    default_deadline_s: float | None = None  # applied when the client sets no gRPC deadline
    # Text is tokenized on host threads before any other check can refuse it, so its size is capped
    # (UTF-8 bytes): GenerateRequest.prompt and TokenizeRequest.text; beyond: INVALID_ARGUMENT.
    max_prompt_bytes: int = flag(
        1 << 20,
        "--max-prompt-bytes",
        "largest text prompt (UTF-8 bytes) of Generate",
        group=ADMISSION,
    )
    max_tokenize_bytes: int = flag(
        1 << 20,
        "--max-tokenize-bytes",
        "largest text (UTF-8 bytes) of Tokenize",
        group=ADMISSION,
    )

    # Scheduling. Prompt tokens prefilled per scheduler step while any stream is decoding, summed over
    # the requests' chunks (at most max(prefill_rows) chunks, each at most max(prefill_buckets) tokens),
    # handed out a page per request in turn, oldest first. It bounds how long a step's prefill holds up
    # the running streams; with none decoding a step takes every row's largest chunk. None:
    # 2 * page_size * max(prefill_rows), two pages of every row, so a step's prefill is at most two
    # forwards over [max(prefill_rows), page_size] tokens on JaxEngine (on tiny / XLA:CPU the best of
    # one, two and four pages a row for both TTFT and TPOT at 16 and 32 streams: BENCHMARKS.md,
    # Serving). At least page_size.
    prefill_token_budget: int | None = flag(
        None,
        "--prefill-token-budget",
        "prompt tokens prefilled per step beside the running decodes, summed over requests "
        "(default: 2 x --page-size x the largest --prefill-rows); bounds how long arrivals hold up "
        "streams. With no stream decoding a step takes a full --prefill-chunk for every row",
        group=SCHEDULING,
    )
    # Long prompts. While no stream is decoding, a prompt with more than a chunk
    # (max(prefill_buckets)) left goes in alone, `long_prefill_chunk` tokens per step, through a
    # one-row program that runs `long_prefill_step` tokens per `forward` instead of a page of every
    # row: on tiny / XLA:CPU 5.6x the prompt tokens per second of the four-row page program with one
    # busy row (BENCHMARKS.md, "One long prompt alone: the long-prompt program"). A token is computed
    # the same way in either program, bit for bit (tests/serving/test_serving_jax.py), so this is a
    # speed choice only. It costs one more compiled
    # prefill program per decode_context_buckets width. None: LONG_PREFILL_CHUNK when max_context is
    # at least 4x that (below, a whole prompt is a few steps of the page program and the extra
    # compile does not pay), else 0 = off. Else a multiple of long_prefill_step, above the chunk.
    long_prefill_chunk: int | None = flag(
        None,
        "--long-prefill-chunk",
        f"with no stream decoding, a prompt with more than --prefill-chunk tokens left goes in "
        f"alone, this many tokens per step, through a one-row program of --long-prefill-step tokens "
        f"per forward (same tokens, several times the speed); 0: off (default: {LONG_PREFILL_CHUNK} "
        f"when --max-context is at least {4 * LONG_PREFILL_CHUNK}, else 0; one more compiled program"
        f" per context width)",
        group=SCHEDULING,
        metavar="TOKENS",
    )
    long_prefill_step: int = flag(
        256,
        "--long-prefill-step",
        "tokens per forward of the long-prompt program, a multiple of --page-size (default: %(default)s)",
        group=SCHEDULING,
        metavar="TOKENS",
    )  # a multiple of page_size (on tiny: 256 beat 128 and 512)
    enable_prefix_cache: bool = flag(True, "--prefix-cache", "reuse cached prompt pages", group=ADMISSION)
    # Speculative decoding (DSpark, a model with draft stages): drafts verified per decode step, 0 =
    # off; at most the model's dspark_block_size. `dspark_confidence` T (None = off): a row verifies
    # the longest prefix of its drafts whose running product of sigmoid(confidence) stays >= T, at
    # least one (the verify program has one draft position anyway), and a step whose rows all want
    # fewer than `dspark` runs a narrower program (every width 1..dspark is compiled at start-up).
    dspark: int = flag(
        0,
        "--dspark",
        "DSpark speculative decoding: draft tokens verified per decode step, at most the model's "
        "dspark_block_size (0: off; needs a checkpoint with DSpark draft stages); greedy output is "
        "unchanged, only the number of decode steps falls",
        group=SCHEDULING,
        metavar="K",
    )
    dspark_confidence: float | None = flag(
        None,
        "--dspark-confidence",
        "with --dspark: each row verifies the longest prefix of its drafts whose product of "
        "estimated acceptance (sigmoid of the confidence head) stays >= T, at least one; every "
        "width 1..K is compiled and a step runs the narrowest that holds its rows (default: off, K "
        "drafts)",
        group=SCHEDULING,
        metavar="T",
    )
    # How prompts are prefilled when a request does not say (`--prefill-mode`): "exact" runs every
    # layer over every prompt token (the reference's numbers; prefix hits bit-identical to cold runs);
    # "ced" runs the encoder layers over the whole prompt and the decoder layers only over its last
    # window (spec 4.2; about twice the prefill throughput on long prompts, not bit-exact). A model
    # without the CED layout serves "exact" only.
    prefill_mode: str = flag(
        "exact",
        "--prefill-mode",
        PREFILL_MODE_HELP + " (per request: GenerateRequest.prefill_mode, the HTTP body's prefill_mode)",
        group=SCHEDULING,
        choices=PREFILL_MODES,
    )
    # Output-side flow control: a decoding request that has generated this many tokens since it got
    # its slot yields the slot when other requests are waiting (its prompt and output so far are
    # registered in the prefix cache and it queues again at the back; its stream goes on where it
    # stopped, with the same tokens). So a request with a very large max_tokens cannot hold a slot
    # while others wait. 0 = off (a request keeps its slot until it finishes).
    decode_segment_tokens: int = flag(
        4096,
        "--decode-segment-tokens",
        "a request that has generated N tokens since it got its slot yields the slot when others "
        "wait, and queues again to go on where it stopped (same tokens; its context comes back from"
        " the prefix cache); 0: off (default: %(default)s)",
        group=SCHEDULING,
        metavar="N",
    )
    # KV tiers below the device pages (serving/scheduling/kv_tiers.py): blocks the prefix cache evicts
    # from the device are kept in host memory (`kv_host_bytes`, LRU) and, pushed off host, on disk
    # (`kv_disk_dir` within `kv_disk_bytes`, LRU; kept across restarts), and come back on a hit
    # instead of being recomputed. 0 / None: off. Needs the prefix cache and an engine that can move
    # pages (`EngineSpec.kv_page_bytes`).
    kv_host_bytes: int = flag(
        0,
        "--kv-host-bytes",
        "host memory for prefix-cache blocks evicted from the device (LRU; they come back on a hit "
        "instead of being recomputed; 0: off)",
        group=ADMISSION,
        metavar="BYTES",
    )
    kv_disk_dir: str | None = flag(
        None,
        "--kv-disk-dir",
        "a directory for blocks pushed off the host tier (atomic checksummed files, kept across "
        "restarts; blocks of another model or config are deleted); needs --kv-disk-bytes",
        group=ADMISSION,
        metavar="DIR",
    )
    kv_disk_bytes: int = flag(
        0,
        "--kv-disk-bytes",
        "the disk tier's budget (LRU)",
        group=ADMISSION,
        metavar="BYTES",
    )

    # Tenants (serving/tenants.py).
    # None: no authentication, identity = GenerateRequest.user. A key, or a file of keys and names.
    api_keys: ApiKeys | None = flags(
        None,
        Flag(
            "--api-key",
            "require this API key on every call (gRPC metadata or HTTP header: authorization: Bearer KEY, "
            "or x-api-key: KEY); for several keys or named tenants use --api-key-file",
            TENANTS,
            parse=_one_key,
        ),
        Flag(
            "--api-key-file",
            "require an API key on every call (authorization: Bearer KEY, or x-api-key: KEY); "
            "the file has one key per line, optionally followed by a name (the tenant's identity)",
            TENANTS,
            parse=ApiKeys.load,
        ),
    )
    # True: one prefix cache for every identity, so a tenant's cached_prompt_tokens and latency reveal
    # whether another tenant sent the same prefix. False: the cache is scoped per identity.
    share_prefix_cache: bool = flag(
        False,
        "--shared-prefix-cache",
        "one prefix cache for all identities (default: one per identity); a tenant can then tell "
        "from cached_prompt_tokens and latency whether another tenant sent a prefix",
        group=TENANTS,
    )
    max_user_length: int = 256  # GenerateRequest.user / AbortRequest.user

    # Images (a model with a vision tower; serving/vision.py). Both front ends share these limits and
    # the feature cache: span rows of recent images keyed by the SHA-256 of their pre-processed pixels,
    # LRU within `feature_cache_bytes` (0: no cache, the ViT runs for every image).
    feature_cache_bytes: int = flag(
        256 * MIB,
        "--feature-cache-bytes",
        "bytes of image span rows kept (LRU, keyed by the pixels' SHA-256) so a repeated image "
        "skips the ViT (0: no cache)",
        group=IMAGES,
    )
    max_images_per_request: int = flag(16, "--max-images-per-request", "beyond: refused", group=IMAGES)
    max_image_bytes: int = flag(
        20 * MIB,
        "--max-image-bytes",
        "one image's encoded bytes",
        group=IMAGES,
    )  # one image's encoded bytes (the Files API's upload limit too)
    # The Files API store (serving/files.py), shared by the HTTP API's /files and gRPC's
    # ImageInput.file_id; and fetching image URLs in HTTP requests (off unless hosts are allowed).
    http_image_fetch: ImageFetchConfig = ImageFetchConfig()
    http_files: FilesConfig = FilesConfig()

    # Server.
    host: str = flag("127.0.0.1", "--host", "address the gRPC server and /metrics listen on", group=SERVER)
    # The ports: 0 = any free port, the default, which suits servers started in-process (tests,
    # benchmarks: they must not collide); the command listens on the well-known ones, and -1 (or 0
    # for HTTP) turns one off there (None: off).
    port: int = flag(0, "--port", "gRPC port (0: any free port)", group=SERVER, command_default="50051")
    metrics_port: int | None = flag(
        0,
        "--metrics-port",
        "Prometheus /metrics port (0: any free, -1: off)",
        group=SERVER,
        command_default="9464",
        parse=port_or_off(-1),
    )
    metrics_host: str = "127.0.0.1"
    # The HTTP API (serving/http: OpenAI / Anthropic formats) in the same process; None = off, 0 = any
    # free port. Its host: None = `host` (loopback unless told otherwise).
    http_port: int | None = flag(
        None,
        "--http-port",
        "HTTP API port: OpenAI Chat Completions / Completions / Responses and Anthropic Messages, as "
        "DeepSeek's hosted API (0 or -1: off)",
        group=SERVER,
        command_default="8000",
        parse=port_or_off(0, -1),
    )
    http_host: str | None = flag(
        None,
        "--http-host",
        "address the HTTP API listens on (default: --host)",
        group=SERVER,
    )
    # Served name and aliases (serving/model_names.py).
    http_models: ModelNames = flag(
        ModelNames(),
        "--model-alias",
        "accept another model name on the HTTP API: NAME, or NAME=thinking / NAME=non-thinking to "
        "force the mode (repeatable; deepseek-v4-flash, deepseek-chat, deepseek-reasoner, ... by default)",
        group=SERVER,
        repeatable=True,
        parse=_model_aliases,
    )
    # A request body's bytes, checked as it arrives (before parsing; beyond: 413). None: the gRPC
    # limits' equivalent, 4 x max_prompt_bytes (JSON escapes) + 1 MiB, plus base64 images
    # (max_images_per_request x max_image_bytes x 4/3) on a model that takes them.
    http_max_body_bytes: int | None = flag(
        None,
        "--http-max-body-bytes",
        "HTTP request body bytes, checked as they arrive, before parsing; beyond: 413 (default: 4 x"
        " --max-prompt-bytes + 1 MiB, plus --max-images-per-request x --max-image-bytes in base64 "
        "on a model that takes images)",
        group=SERVER,
    )
    # A non-streaming request not answered within this many seconds gets its 200 and headers, then an
    # empty line every this many seconds until its JSON body, as DeepSeek's hosted API does while a
    # request waits (api-surface.md, SSE keep-alive): a client's read timeout then measures silence,
    # not the work, and JSON parsers skip the leading whitespace. An error after that comes as the
    # error body under the 200 already sent. 0: off (every answer waits for its status).
    http_keepalive_s: float = flag(
        5.0,
        "--http-keepalive",
        "a non-streaming answer not ready within S seconds gets its 200 and then an empty line "
        "every S seconds until its JSON, as DeepSeek's API does (clients' read timeouts measure "
        "silence, not work; a later error comes as the error body under that 200); 0: off (default:"
        " %(default)s)",
        group=SERVER,
        metavar="S",
    )
    http_pricing: PricingConfig = PricingConfig()  # the hosted prices of the cost ledger (accounting.py)
    grace_period_s: float = flag(
        30.0,
        "--grace-period",
        "seconds in-flight streams get on SIGTERM",
        group=SERVER,
        metavar="S",
    )  # after SIGTERM, in-flight streams get this long to finish
    http_limits: AdmissionLimits = AdmissionLimits()  # 2500 concurrent; the effort-max tier (limits.py)
    # Threads of the pools that work before the scheduler (serving/work_pools.py): request preparation
    # (HTTP parsing, rendering, tokenizing; gRPC prompts and images), image URL downloads, and Tokenize
    # calls. A tenant runs at most half of a pool's threads at once; further jobs wait their turn.
    prepare_workers: int = flag(
        6,
        "--prepare-workers",
        "threads that prepare requests (HTTP parsing, rendering, tokenizing; gRPC prompts); one "
        "tenant (API key, else client address) runs at most half of them",
        group=ADMISSION,
        metavar="N",
    )
    image_fetch_workers: int = flag(
        8,
        "--image-fetch-workers",
        "threads that download image URLs; one tenant (API key, else client address) runs at most "
        "half of them",
        group=ADMISSION,
        metavar="N",
    )
    tokenize_workers: int = flag(
        2,
        "--tokenize-workers",
        "threads that run Tokenize calls; one tenant (API key, else client address) runs at most "
        "half of them",
        group=ADMISSION,
        metavar="N",
    )

    def __post_init__(self):
        check_shapes(
            max_slots=self.max_slots,
            page_size=self.page_size,
            num_pages=1 if self.num_pages is None else self.num_pages,  # the default is >= 1 (below)
            max_context=self.max_context,
            prefill_buckets=self.prefill_buckets,
            named=lambda field: named(self, field),
        )
        if self.num_pages is None:  # frozen: the default is filled in once, here
            object.__setattr__(self, "num_pages", self.max_slots * (self.max_context // self.page_size))
        if self.decode_buckets is None:
            buckets = default_decode_buckets(self.max_slots, batch_invariant=self.batch_invariant)
            object.__setattr__(self, "decode_buckets", buckets)
        d = tuple(self.decode_buckets)
        if not d or list(d) != sorted(set(d)) or d[0] < 1 or d[-1] != self.max_slots:
            raise ValueError(
                f"decode_buckets must be ascending, positive and end at max_slots ({self.max_slots}), got {d}"
            )
        if self.batch_invariant and d[0] < min(INVARIANT_DECODE_ROWS, self.max_slots):
            raise ValueError(
                f"decode_buckets {list(d)}: batches below {min(INVARIANT_DECODE_ROWS, self.max_slots)} rows "
                "break batch invariance (a row's result depends on the batch's size); turn "
                "batch_invariant off (--no-batch-invariant) to run them"
            )
        page = f"{named(self, 'page_size')} {self.page_size}"
        context = f"{named(self, 'max_context')} {self.max_context}"
        slots = f"{named(self, 'max_slots')} {self.max_slots}"
        if self.decode_context_buckets is None:
            object.__setattr__(
                self, "decode_context_buckets", default_context_buckets(self.max_context, self.page_size)
            )
        c = tuple(self.decode_context_buckets)
        if (
            not c
            or list(c) != sorted(set(c))
            or c[-1] > self.max_context
            or any(t < 1 or t % self.page_size for t in c)
        ):
            raise ValueError(
                f"{named(self, 'decode_context_buckets')} must be ascending multiples of {page}, at most "
                f"{context}, got {c}"
            )
        if c[-1] < self.max_context:  # the last width holds a whole request
            object.__setattr__(self, "decode_context_buckets", (*c, self.max_context))
        if self.prefill_rows is None:
            rows = min(4, self.max_slots)
            object.__setattr__(
                self, "prefill_rows", (rows,) if self.batch_invariant else tuple(sorted({1, rows}))
            )
        r = tuple(self.prefill_rows)
        if not r or list(r) != sorted(set(r)) or r[0] < 1 or r[-1] > self.max_slots:
            raise ValueError(
                f"{named(self, 'prefill_rows')} must be ascending row counts in 1..{slots}, got {r}"
            )
        if self.batch_invariant and len(r) > 1:
            raise ValueError(
                f"{named(self, 'prefill_rows')} {list(r)}: several prefill sizes break batch invariance (a "
                "request's output would depend on what is prefilled beside it); give one count, or turn "
                "batch_invariant off (--no-batch-invariant)"
            )
        if self.prefill_token_budget is None:
            object.__setattr__(self, "prefill_token_budget", 2 * self.page_size * r[-1])
        if self.prefill_token_budget < self.page_size:
            raise ValueError(
                f"{named(self, 'prefill_token_budget')} must be >= {page} (a page per step at least), "
                f"got {self.prefill_token_budget}"
            )
        step = self.long_prefill_step
        if step < 1 or step % self.page_size:
            raise ValueError(
                f"{named(self, 'long_prefill_step')} must be a positive multiple of {page}, got {step}"
            )
        if self.long_prefill_chunk is None:
            object.__setattr__(self, "long_prefill_chunk", default_long_prefill_chunk(self.max_context))
        long_chunk = self.long_prefill_chunk
        if long_chunk and (
            long_chunk % step or long_chunk <= self.prefill_buckets[-1] or long_chunk > self.max_context
        ):
            raise ValueError(
                f"{named(self, 'long_prefill_chunk')} must be 0 (off) or a multiple of "
                f"{named(self, 'long_prefill_step')} {step} above the prefill chunk (--prefill-chunk) "
                f"{self.prefill_buckets[-1]} and at most {context}, "
                f"got {long_chunk}"
            )
        positive = (
            "max_tokens_limit",
            "default_max_tokens",
            "max_prompt_bytes",
            "max_tokenize_bytes",
            "prepare_workers",
            "image_fetch_workers",
            "tokenize_workers",
            "max_user_length",
            "max_images_per_request",
            "max_image_bytes",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{named(self, name)} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.http_keepalive_s < math.inf:  # NaN and inf too
            raise ValueError(
                f"{named(self, 'http_keepalive_s')} must be a finite number >= 0 (0: off), "
                f"got {self.http_keepalive_s}"
            )
        if self.http_max_body_bytes is not None and self.http_max_body_bytes < 1:
            body = named(self, "http_max_body_bytes")
            raise ValueError(f"{body} must be >= 1 or None, got {self.http_max_body_bytes}")
        if self.num_pages * self.page_size < self.max_context:
            raise ValueError(
                f"{named(self, 'num_pages')} {self.num_pages} x {named(self, 'page_size')} {self.page_size} "
                f"must hold one request of max_context (--max-context) {self.max_context} tokens (at least "
                f"{-(-self.max_context // self.page_size)} pages)"
            )
        if self.max_running is not None and not 1 <= self.max_running <= self.max_slots:
            raise ValueError(
                f"{named(self, 'max_running')} must be >= 1 and at most {named(self, 'max_slots')} "
                f"{self.max_slots}, got {self.max_running}"
            )
        if self.feature_cache_bytes < 0:
            cache = named(self, "feature_cache_bytes")
            raise ValueError(f"{cache} must be >= 0 (0: no cache), got {self.feature_cache_bytes}")
        for name in ("max_queued", "max_logprobs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{named(self, name)} must be >= 0, got {getattr(self, name)}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens {self.default_max_tokens} must not exceed "
                f"{named(self, 'max_tokens_limit')} {self.max_tokens_limit}"
            )
        if not (math.isfinite(self.grace_period_s) and self.grace_period_s >= 0):
            grace = named(self, "grace_period_s")
            raise ValueError(f"{grace} must be a finite number >= 0, got {self.grace_period_s}")
        if not isinstance(self.dspark, int) or self.dspark < 0:
            raise ValueError(f"dspark (--dspark) must be an integer >= 0 (0: off), got {self.dspark!r}")
        t = self.dspark_confidence
        if t is not None:
            if not (isinstance(t, (int, float)) and math.isfinite(t) and 0.0 < t <= 1.0):
                raise ValueError(f"dspark_confidence (--dspark-confidence) must be in (0, 1], got {t!r}")
            if self.dspark == 0:
                raise ValueError("dspark_confidence (--dspark-confidence) needs dspark (--dspark) > 0")
        if not isinstance(self.decode_segment_tokens, int) or self.decode_segment_tokens < 0:
            raise ValueError(
                "decode_segment_tokens (--decode-segment-tokens) must be an integer >= 0 (0: off), "
                f"got {self.decode_segment_tokens!r}"
            )
        for name in ("kv_host_bytes", "kv_disk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} ({flag}) must be an integer >= 0 (0: off), got {value!r}")
        if (self.kv_disk_dir is None) != (self.kv_disk_bytes == 0):
            raise ValueError(
                "kv_disk_dir (--kv-disk-dir) and kv_disk_bytes (--kv-disk-bytes) go together: "
                f"got {self.kv_disk_dir!r} and {self.kv_disk_bytes}"
            )
        if self.kv_tiers and not self.enable_prefix_cache:
            raise ValueError(
                "kv_host_bytes / kv_disk_dir (--kv-host-bytes / --kv-disk-dir: KV tiers) need the "
                "prefix cache (--no-prefix-cache given)"
            )
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(
                f"prefill_mode (--prefill-mode) must be one of {list(PREFILL_MODES)}, "
                f"got {self.prefill_mode!r}"
            )
        for name in PORT_FIELDS:
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                off = "" if name == "port" else ", or None (off)"
                raise ValueError(
                    f"{named(self, name)} must be in 0..65535 (0: any free port){off}, got {port}"
                )

    @property
    def kv_tiers(self) -> bool:
        """Whether evicted prefix-cache blocks go to host memory or disk."""
        return self.kv_host_bytes > 0 or self.kv_disk_dir is not None

    @property
    def http_images(self):
        """The HTTP API's per-request image limits: the same as gRPC's (one declaration, above)."""
        return ImageInputConfig(
            max_images_per_request=self.max_images_per_request, max_image_bytes=self.max_image_bytes
        )

    @property
    def running_limit(self) -> int:
        return self.max_slots if self.max_running is None else self.max_running

    def check_engine(self, spec: EngineSpec) -> None:
        """Raises ValueError if the engine was not built with this config's shapes."""
        pairs = {
            "max_slots": (self.max_slots, spec.max_slots),
            "page_size": (self.page_size, spec.page_size),
            "num_pages": (self.num_pages, spec.num_pages),
            "max_context": (self.max_context, spec.max_context),
            "prefill_buckets": (tuple(self.prefill_buckets), tuple(spec.prefill_buckets)),
        }
        bad = {k: v for k, v in pairs.items() if v[0] != v[1]}
        if bad:
            raise ValueError(f"engine shapes differ from ServeConfig (config, engine): {bad}")
        if self.dspark and self.dspark not in spec.dspark_widths:
            widths = spec.dspark_widths or "none: the engine has no DSpark draft stages"
            raise ValueError(f"dspark (--dspark) {self.dspark}: the engine's draft widths are {widths}")
        if self.dspark_confidence is not None and tuple(spec.dspark_widths) != tuple(
            range(1, self.dspark + 1)
        ):
            raise ValueError(
                f"dspark_confidence (--dspark-confidence) needs every draft width 1..{self.dspark} compiled, "
                f"the engine has {spec.dspark_widths}"
            )
        if self.prefill_mode == "ced" and not spec.ced_window:
            raise ValueError("prefill_mode (--prefill-mode) 'ced': the model has no CED layout (exact only)")
        if self.kv_tiers and spec.kv_page_bytes <= 0:
            raise ValueError(
                "kv_host_bytes / kv_disk_dir (KV tiers): the engine cannot copy pages out of its state "
                "(a multi-host engine)"
            )
        if self.max_logprobs > spec.max_logprobs:
            raise ValueError(f"max_logprobs {self.max_logprobs} exceeds the engine's {spec.max_logprobs}")
