"""`ced-jax client` refuses what it cannot send as asked (issue 33.8): a port past 65535 (gRPC
silently took it modulo 65536) and numbers outside their proto field (tracebacks before)."""

import pytest

from ced_cli.main import main

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["127.0.0.1:117847"], ("addr", "port must be in [1, 65535], got 117847")),
        (["127.0.0.1:0"], ("addr", "port must be in [1, 65535], got 0")),
        (["localhost"], ("addr", "expected host:port")),
        (["127.0.0.1:50051", "--seed", str(2**32)], ("--seed", "[0, 4294967295], got 4294967296")),
        (["127.0.0.1:50051", "--seed", "-1"], ("--seed", "got -1")),
        (["127.0.0.1:50051", "--max-tokens", str(2**31)], ("--max-tokens", "[0, 2147483647]")),
        (["127.0.0.1:50051", "--top-k", str(2**40)], ("--top-k", "[0, 2147483647]")),
        (["127.0.0.1:50051", "--logprobs", "99999999999"], ("--logprobs", "[0, 2147483647]")),
        (["127.0.0.1:50051", "--top-k", "many"], ("--top-k", "expected an integer, got 'many'")),
    ],
)
def test_out_of_range_arguments_exit_2_naming_the_flag(args, needles, capsys):
    with pytest.raises(SystemExit) as e:
        main(["client", *args, "--prompt", "hi"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, (needle, last)
