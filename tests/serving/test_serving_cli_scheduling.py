"""`ced-jax serve`'s scheduling flags (--prefill-rows, --prefill-token-budget, --long-prefill-chunk,
--long-prefill-step, --decode-segment-tokens):
bad values exit 2 with one line naming the flag, before any model is loaded; good ones reach the
ServeConfig."""

import pytest

from ced_cli.main import main

pytestmark = pytest.mark.timeout(120)

BASE = ["serve", "tiny", "--port", "0", "--metrics-port", "-1", "--http-port", "0"]


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("loaded a model before checking the options")

    monkeypatch.setattr("ced_jax.api.load", refuse)


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--prefill-rows", "4,2"], ("prefill_rows (--prefill-rows)", "ascending", "(4, 2)")),
        (["--prefill-rows", "0"], ("prefill_rows (--prefill-rows)", "1..max_slots (--max-slots) 32")),
        (["--prefill-rows", "64"], ("prefill_rows (--prefill-rows)", "max_slots (--max-slots) 32", "64")),
        (["--max-slots", "2", "--prefill-rows", "1,4"], ("--prefill-rows", "max_slots (--max-slots) 2")),
        (["--prefill-rows", "2,,4"], ("prefill_rows (--prefill-rows)", "comma-separated", "'2,,4'")),
        (["--prefill-rows", "four"], ("--prefill-rows", "'four'")),
        (
            ["--prefill-rows", "2,4"],
            ("prefill_rows (--prefill-rows) [2, 4]", "break batch invariance", "--no-batch-invariant"),
        ),
        (["--prefill-token-budget", "15"], ("--prefill-token-budget", ">= page_size (--page-size) 16", "15")),
        (["--prefill-token-budget", "-1"], ("--prefill-token-budget", "-1")),
        (["--page-size", "32", "--prefill-token-budget", "16"], ("--prefill-token-budget", "32")),
        (["--decode-segment-tokens", "-5"], ("--decode-segment-tokens", ">= 0", "-5")),
        (["--long-prefill-step", "24"], ("--long-prefill-step", "(--page-size) 16", "24")),
        (["--long-prefill-chunk", "300"], ("--long-prefill-chunk", "(--long-prefill-step) 256", "300")),
        (
            ["--long-prefill-chunk", "256", "--prefill-chunk", "256"],
            ("--long-prefill-chunk", "above the prefill chunk (--prefill-chunk)"),
        ),
        (
            ["--max-context", "4096", "--long-prefill-chunk", "8192"],
            ("--long-prefill-chunk", "at most max_context (--max-context) 4096", "8192"),
        ),
        (["--kv-host-bytes", "-3"], ("--kv-host-bytes", ">= 0", "-3")),
        (["--http-keepalive", "-1"], ("--http-keepalive", ">= 0", "-1")),
        (["--http-keepalive", "nan"], ("--http-keepalive", "finite", "nan")),
        (["--kv-disk-dir", "/tmp/ced-kv"], ("--kv-disk-dir", "--kv-disk-bytes")),
        (["--kv-disk-bytes", "100"], ("--kv-disk-dir", "--kv-disk-bytes")),
        (["--kv-host-bytes", "100", "--no-prefix-cache"], ("--kv-host-bytes", "prefix cache")),
    ],
)
def test_bad_scheduling_flags_exit_2_in_one_line(extra, needles, capsys, nothing_loads):
    capsys.readouterr()
    assert main([*BASE, *extra]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    for needle in needles:
        assert needle in lines[0], (extra, lines[0])


def test_scheduling_flags_reach_the_serve_config(monkeypatch):
    seen = {}

    def fake_serve(config, load):
        seen["config"] = config
        return 0

    monkeypatch.setattr("serving.server.serve", fake_serve)
    argv = [*BASE, "--prefill-rows", "2,4", "--prefill-token-budget", "96", "--no-batch-invariant"]
    assert main(argv) == 0
    assert seen["config"].prefill_rows == (2, 4) and seen["config"].prefill_token_budget == 96
    assert not seen["config"].batch_invariant
    assert seen["config"].decode_segment_tokens == 4096  # the default: on
    assert main([*BASE, "--decode-segment-tokens", "0"]) == 0
    assert seen["config"].decode_segment_tokens == 0
    argv = [*BASE, "--kv-host-bytes", "4096", "--kv-disk-dir", "/tmp/ced-kv", "--kv-disk-bytes", "8192"]
    assert main(argv) == 0
    c = seen["config"]
    assert (c.kv_host_bytes, c.kv_disk_dir, c.kv_disk_bytes, c.kv_tiers) == (4096, "/tmp/ced-kv", 8192, True)
    assert main([*BASE, "--max-slots", "2"]) == 0  # the defaults follow the shapes
    assert seen["config"].prefill_rows == (2,) and seen["config"].prefill_token_budget == 64
    assert main([*BASE]) == 0  # batch invariant by default: decode from 8 rows, one prefill size
    assert seen["config"].batch_invariant
    assert (seen["config"].decode_buckets, seen["config"].prefill_rows) == ((8, 16, 32), (4,))
    # The long-prompt program: on from 8192 tokens of context (auto is 39,888 on tiny), off below.
    assert (seen["config"].long_prefill_chunk, seen["config"].long_prefill_step) == (2048, 256)
    assert main([*BASE, "--max-context", "4096"]) == 0
    assert seen["config"].long_prefill_chunk == 0
    assert main([*BASE, "--long-prefill-chunk", "1024", "--long-prefill-step", "128"]) == 0
    assert (seen["config"].long_prefill_chunk, seen["config"].long_prefill_step) == (1024, 128)
    assert main([*BASE, "--long-prefill-chunk", "0"]) == 0
    assert seen["config"].long_prefill_chunk == 0
    assert main([*BASE, "--no-batch-invariant"]) == 0  # the batch in use: from 1 row
    assert (seen["config"].decode_buckets, seen["config"].prefill_rows) == ((1, 2, 4, 8, 16, 32), (1, 4))


def test_a_busy_kv_disk_dir_fails_before_the_model_loads(tmp_path, capsys, nothing_loads):
    from serving.scheduling.kv_tiers import DiskTier

    held = DiskTier(tmp_path / "kv", 1 << 20, b"\0" * 16)  # another server's tier
    try:
        capsys.readouterr()
        assert main([*BASE, "--kv-disk-dir", str(tmp_path / "kv"), "--kv-disk-bytes", "4096"]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and "--kv-disk-dir" in lines[0] and "in use by another process" in lines[0]
    finally:
        held.close()


def test_a_foreign_kv_disk_dir_exits_2_and_keeps_its_files(tmp_path, capsys, nothing_loads):
    (tmp_path / "notes.tmp").write_text("notes\n")
    (tmp_path / "report.kvb").write_text("x\n")
    capsys.readouterr()
    assert main([*BASE, "--kv-disk-dir", str(tmp_path), "--kv-disk-bytes", "1000000"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "--kv-disk-dir" in lines[0] and "not a KV disk tier" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp", "report.kvb"]
    assert (tmp_path / "notes.tmp").read_text() == "notes\n"
    assert (tmp_path / "report.kvb").read_text() == "x\n"


def test_auto_context_and_output_limit_follow_the_kv_budget(monkeypatch, capsys):
    """--max-context auto (the default): on CPU the largest context whose KV pages for --max-slots
    sequences fit serving.planning.capacity's 4 GiB budget, at most the model's own; --num-pages bounds it;
    --max-tokens-limit auto follows it. The HTTP API is on by default (port 8000; 0 turns it off)."""
    from ced_jax.config import preset
    from serving.planning import capacity

    seen = {}
    monkeypatch.setattr("serving.server.serve", lambda config, load: seen.update(config=config) or 0)
    per_token = capacity.kv_bytes_per_token(preset("tiny"))
    for slots in (32, 1):
        assert main([*BASE, "--max-slots", str(slots)]) == 0
        c = seen["config"]
        expected = min(
            preset("tiny").max_position_embeddings, capacity.CPU_KV_BUDGET_BYTES // (slots * per_token)
        )
        # Whole pages; below the pages alone by the per-slot state the ledger also counts (rings etc.).
        assert c.max_context % 16 == 0 and expected - 8 * 16 <= c.max_context <= expected
        assert c.max_tokens_limit == c.max_context and c.http_port is None
    assert seen["config"].max_context == preset("tiny").max_position_embeddings  # 1 slot: the model's limit
    assert main([*BASE, "--max-slots", "4", "--num-pages", "100"]) == 0
    assert seen["config"].max_context == 100 * 16 // 4 // 16 * 16
    assert main([*BASE, "--max-context", "4096", "--max-tokens-limit", "512"]) == 0
    assert (seen["config"].max_context, seen["config"].max_tokens_limit) == (4096, 512)
    argv = ["serve", "tiny", "--port", "0", "--metrics-port", "-1", "--max-context", "64"]
    assert main(argv) == 0 and seen["config"].http_port == 8000  # HTTP on by default
    assert main([*argv, "--http-port", "-1"]) == 0 and seen["config"].http_port is None
    capsys.readouterr()
    assert main([*BASE, "--max-context", "lots"]) == 2
    assert "max_context (--max-context): expected a whole number or auto" in capsys.readouterr().err
    assert main([*BASE, "--max-slots", "4", "--num-pages", "3"]) == 2
    assert "--num-pages 3" in capsys.readouterr().err
